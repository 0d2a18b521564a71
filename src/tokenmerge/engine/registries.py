"""diffusers' cache hooks on the sub-modules a patch merges around: made to see whole tokens, or refused.

An attention cache (Pyramid Attention Broadcast, FasterCache's attention hook, TaylorSeer) stores a sub-module's
output at one step and returns it, or a prediction made from several such outputs, at later steps. The patch's
torch hooks run outside diffusers' hook chain (``module.forward``), so on a merged target the cache would keep
merged tokens of one step's plan for a later step's plan to unmerge: tokens would get other tokens' outputs.

So a merged target that carries such a hook is merged from inside the chain instead: the technique's own hooks
as a diffusers ``ModelHook`` (``ChainHook``), registered below the cache's, merge the target's input and unmerge
its output, and the cache stores and returns full-resolution outputs, each token its own: what it gives on the
unmerged tokens. Token reuse's block hooks go below a block cache's (First Block Cache, MagCache) the same way.
Both orders: at apply time the cache's hooks are lifted above the patch's (removed and registered again: their
state starts as fresh as at registration, before any step; a hook added after the cache that does not support
removal, as layerwise casting, makes that a refusal); a cache added after the patch is caught at its own
registration (the patch watches the registries of the modules it merges) and lands above the patch's hook.

A cache hook that cannot see whole tokens is refused with a ``ValueError``, at ``apply_patch`` or at the cache's
own registration: on a sub-module inside a merged target (whose tokens are merged whichever way), or on a block
(or inside one) whose tokens ``scope="block"`` merges.
"""

from __future__ import annotations

import sys

__all__ = ["CACHE_HOOKS", "HARMLESS_HOOKS", "REGISTRY_ATTR", "CHAIN_HOOK", "ChainHook", "bad_hook",
           "cache_message", "route", "watch_registries", "unwatch"]

REGISTRY_ATTR = "_diffusers_hook"  # where diffusers keeps a module's HookRegistry (diffusers.hooks.hooks)
CHAIN_HOOK = "tokenmerge_chain_hook"  # the name of the patch's own hook in a registry (its ChainHook)

# diffusers hook names (the constants in diffusers/hooks/*.py) whose hook may return an output stored or predicted
# at an earlier call instead of computing it from this call's input
CACHE_HOOKS = {
    "pyramid_attention_broadcast": "Pyramid Attention Broadcast (apply_pyramid_attention_broadcast)",
    "faster_cache_block": "FasterCache (apply_faster_cache)",
    "faster_cache_denoiser": "FasterCache (apply_faster_cache)",
    "taylorseer_cache": "the TaylorSeer cache (apply_taylorseer_cache)",
    "fbc_leader_block_hook": "First Block Cache (apply_first_block_cache)",
    "fbc_block_hook": "First Block Cache (apply_first_block_cache)",
    "mag_cache_leader_block_hook": "MagCache (apply_mag_cache)",
    "mag_cache_block_hook": "MagCache (apply_mag_cache)",
    "sea_cache_root": "SeaCache", "sea_cache_leader_block": "SeaCache", "sea_cache_block": "SeaCache",
    "sea_cache_post_norm": "SeaCache",
    "text_kv_cache_transformer": "the text K/V cache", "text_kv_cache_block": "the text K/V cache",
    # not a cache, but it blurs the queries as a square grid of tokens, which merged tokens are not
    "smoothed_energy_guidance_hook": "Smoothed Energy Guidance",
}
# hooks that compute from the call's own input every time: casting, offloading, layer skipping (and the patch's)
HARMLESS_HOOKS = frozenset({"layerwise_casting", "peft_autocast_disable", "group_offloading",
                            "layer_execution_tracker", "lazy_prefetch_group_offloading", "layer_skip_hook", CHAIN_HOOK})


class ChainHook:
    """A module's hooks as a diffusers ``ModelHook``: the technique's own pre-hook ``pre(module, args, kwargs)`` and
    hook ``post(module, args, output)``, called from inside the module's hook chain (below a cache's hook). Computes
    from its call's input every time (not stateful); ``detach()`` makes it pass everything through."""

    _is_stateful = False

    def __init__(self, pre, post):
        self.pre, self.post = pre, post
        self.fn_ref = None

    def detach(self) -> None:
        self.pre = self.post = None

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):  # (diffusers' spelling)
        return module

    def detach_hook(self, module):
        return module

    def reset_state(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        changed = None if self.pre is None else self.pre(module, args, kwargs)
        return (args, kwargs) if changed is None else changed

    def post_forward(self, module, output):
        changed = None if self.post is None else self.post(module, (), output)
        return output if changed is None else changed


def what_hook(name: str, hook) -> str | None:
    """What makes the hook ``name`` unsafe on a module that sees merged tokens, or ``None``."""
    if name in CACHE_HOOKS:
        return CACHE_HOOKS[name]
    if name not in HARMLESS_HOOKS and getattr(hook, "_is_stateful", False):
        return f"the stateful diffusers hook {name!r} ({type(hook).__name__}, which may return an output kept " \
               "from an earlier step)"
    return None


def bad_hook(registry) -> str | None:
    """What makes a diffusers HookRegistry unsafe on a module that sees merged tokens, or ``None``."""
    hooks = getattr(registry, "hooks", None)
    if not isinstance(hooks, dict):
        return None
    for name, hook in hooks.items():
        what = what_hook(name, hook)
        if what is not None:
            return what
    return None


def cache_message(technique, path: str, what: str, later: bool, why: str) -> str:
    """The refusal of a cache hook ``what`` on ``path`` (``later``: registered after the patch), and ``why``, in
    the words of the patch's ``technique`` (its class: ``technique.py``'s ``cache_message``)."""
    when = "cannot be added after the patch" if later else "is enabled"
    return technique.cache_message(path, what, when, why)


def _hooks_module():
    """``diffusers.hooks`` where diffusers is in use and has it, else ``None`` (never imports diffusers itself)."""
    if "diffusers" not in sys.modules:
        return None
    try:
        import diffusers.hooks as hooks
    except ImportError:  # a diffusers before its hooks: no cache to combine with
        return None
    return hooks if hasattr(hooks, "HookRegistry") else None


def route(patch, index: int, t: int, registry, path: str) -> None:
    """Merge target ``t`` of block ``index`` (at ``path``) from inside its hook chain, below every hook of
    ``registry`` from its first unsafe one on (those are registered again above the patch's)."""
    if CHAIN_HOOK in registry.hooks:
        return
    order = list(registry._hook_order)
    first = next((i for i, n in enumerate(order) if what_hook(n, registry.hooks[n]) is not None), len(order))
    stuck = _stuck(registry, first)
    if stuck is not None:
        raise ValueError(f"tokenmerge: {path} carries {bad_hook(registry)}, and the diffusers hook {stuck!r} added "
                         "after it cannot be registered again (it does not support removal), so the patch cannot "
                         "merge below the cache there; add the cache after that hook, or apply the patch first")
    _under(registry, first, lambda: _register(registry, patch.technique.chain_hook(index, t), CHAIN_HOOK))
    for handle in patch.technique.target_handles.pop((index, t), ()):  # its torch hooks: merged inside now
        handle.remove()


def _stuck(registry, index: int) -> str | None:
    """The first hook from position ``index`` of the chain on that cannot be removed and registered again (only
    the caches and the patch's own hook are: casting and offloading hooks change weights when they are), or
    ``None``."""
    for name in list(registry._hook_order)[index:]:
        if name != CHAIN_HOOK and what_hook(name, registry.hooks[name]) is None:
            return name
    return None


def _under(registry, index: int, change) -> None:
    """``change()`` the hooks below position ``index`` of ``registry``'s chain: the hooks from ``index`` on are
    removed (from the top: diffusers relinks a chain right only there) and registered again after it."""
    lifted = [(n, registry.hooks[n]) for n in list(registry._hook_order)[index:]]
    for name, _ in reversed(lifted):
        registry.remove_hook(name, recurse=False)
    change()
    for name, hook in lifted:
        _register(registry, hook, name)


def _register(registry, hook, name: str) -> None:
    """``registry.register_hook`` itself (not the patch's watch on it)."""
    type(registry).register_hook(registry, hook, name)


class _Registration:
    """``register_hook`` of a registry on a module the patch merges around: a hook that would see merged tokens of
    an earlier step lands above the patch's own (a target: ``why`` is ``None``), or is refused with ``why``."""

    __slots__ = ("patch", "registry", "path", "target", "why")

    def __init__(self, patch, registry, path: str, target, why: str | None):
        self.patch, self.registry, self.path, self.target, self.why = patch, registry, path, target, why

    def __call__(self, hook, name: str) -> None:
        what = what_hook(name, hook)
        if what is not None and self.why is not None:
            raise ValueError(cache_message(self.patch.technique, self.path, what, later=True, why=self.why))
        if what is not None:
            route(self.patch, *self.target, self.registry, self.path)
        _register(self.registry, hook, name)


def watch_registries(patch, region, targets) -> None:
    """Route the targets that carry an unsafe hook already, and watch the registries of the ``region`` modules
    (``(path, module)``: every module that sees changed tokens) for hooks added later.

    ``targets``: ``{id(module): (block index, target index)}`` of the modules whose technique hooks can run below
    a cache's (``refusals.routed``).
    """
    hooks = _hooks_module()
    if hooks is None:
        return
    kept = patch.registries
    for path, module in region:
        created = REGISTRY_ATTR not in module.__dict__
        registry = hooks.HookRegistry.check_if_exists_or_initialize(module)
        if not all(hasattr(registry, a) for a in ("hooks", "_hook_order", "remove_hook", "_module_ref")):
            continue  # a registry of another shape: on_call's check still refuses an unsafe hook on it
        target = targets.get(id(module))
        why = patch.technique.refuses_cache(patch.config, target is not None)
        if why is None and bad_hook(registry) is not None:
            route(patch, *target, registry, path)
        registry.register_hook = _Registration(patch, registry, path, target, why)
        kept.append((module, registry, created))
    _forget_children(patch.site.module)


def unwatch(patch) -> None:
    """Undo ``watch_registries`` and the routing: the patch's hooks out of the registries, the registries it made
    and left empty removed."""
    registries, patch.registries = patch.registries, []
    for module, registry, created in registries:
        registry.__dict__.pop("register_hook", None)
        if CHAIN_HOOK in registry.hooks:
            above = registry._hook_order.index(CHAIN_HOOK) + 1
            if _stuck(registry, above) is None:
                _under(registry, above, lambda registry=registry: registry.remove_hook(CHAIN_HOOK, recurse=False))
            else:  # a hook added later that cannot be registered again: the patch's stays, and passes through
                registry.hooks[CHAIN_HOOK].detach()
        if created and not registry.hooks and module.__dict__.get(REGISTRY_ATTR) is registry:
            del module.__dict__[REGISTRY_ATTR]
    _forget_children(patch.site.module)


def _forget_children(denoiser) -> None:
    """The denoiser's registry lists its children's registries once (cache contexts): registries were added or
    removed below it."""
    registry = denoiser.__dict__.get(REGISTRY_ATTR)
    if hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()
