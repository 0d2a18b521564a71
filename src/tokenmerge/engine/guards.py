"""Refusals of combinations that would otherwise give wrong results, or silently change nothing, and the one
adapter that makes a combination work (ToDo on fused QKV projections).

- diffusers' cache hooks (``diffusers.hooks``): an attention cache on a merged target is made to see whole tokens,
  in both orders of enabling, and one that cannot be (inside a target, or with ``scope="block"``) is refused, at
  apply time or at the cache's own registration (caches.py). Hooks at block level (First Block Cache, MagCache,
  SeaCache, TaylorSeer's lite mode) store whole blocks' outputs, in full token space, and are left alone with the
  default scope; so are attention caches on sub-modules that ToDo only pools the keys and values of. As a last
  check, each denoiser call looks for an unsafe hook that reached a merged module another way (one dictionary
  lookup per merged sub-module and call, nothing per block).
- ``torch.compile``: dynamo does not guard on empty hook dicts, so code compiled before the patch would keep running
  unpatched (and code compiled after a removal would ignore a later patch). Installing and removing a patch drop
  the code compiled for the denoiser's modules' ``forward`` (``forget_compiled``): the next compiled call is traced
  again, with the hooks as they are. Blocks (or their sub-modules) compiled in place (``Module.compile()``, regional
  compilation) run the patch's hooks apart from the denoiser's call, which they need: refused, at apply time or at
  the first call after such a compile.
- ToDo on an ``attn1`` that is a cross-attention (``only_cross_attention``, LDM's ``disable_self_attn``) would
  change nothing: an error. A call whose token grid is smaller than the merge window (a preview, a hires-fix's
  first pass) runs unmerged, with one warning per patch; a level of it where no window fits while others merge
  is left unmerged alike.
- ToDo on fused projections (``fuse_qkv_projections``): diffusers' fused processor sends keys and values given
  as ``encoder_hidden_states`` through ``attn.to_kv``, which a fused self-attention lacks; the patch gives it
  one that takes the key and value rows of ``to_qkv`` (not a registered sub-module: nothing enters the state
  dict), and removes it with the patch.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from ..config import ToDoConfig
from ..families.spec import CROSS, JOINT, MLP, SELF
from ..merge import num_windows
from .caches import (INSIDE, REGISTRY_ATTR, REUSING_HOOKS, bad_hook, cache_message, unwatch, watch_registries,
                     why_refused)

__all__ = ["check_apply", "on_call", "unmerged", "attach", "detach", "forget_compiled", "FusedKV", "REUSING_HOOKS"]

_GUARD_ATTR = "_tokenmerge_guard"  # the per-patch record of what on_call watches (on the DenoiserPatch)


# ---- what a patch merges ------------------------------------------------------------------------------------
def _merges(config) -> bool:
    """Whether the config can merge tokens at all (ToMe, or ToDo's query merging)."""
    return config.ratio > 0 or (config.ratio_end or 0) > 0


def _wanted(config, kind: str) -> bool:
    return {SELF: config.merge_attn, JOINT: config.merge_attn, CROSS: config.merge_crossattn,
            MLP: config.merge_mlp}[kind]


def _targets(config, blocks, kinds=None):
    """``(path, module, kind)`` of the sub-modules the patch hooks in ``blocks`` (``kinds``: only these)."""
    for site in blocks:
        for spec in site.targets:
            sub = getattr(site.module, spec.attr, None)
            if isinstance(sub, nn.Module) and _wanted(config, spec.kind) and (kinds is None or spec.kind in kinds):
                yield f"{site.path}.{spec.attr}", sub, spec.kind


def _merged_region(config, blocks) -> list[tuple[str, nn.Module]]:
    """Every module that sees merged tokens: the merged targets and everything inside them (with
    ``scope="block"``: the blocks themselves, whose input is merged before any hook of theirs runs)."""
    if not _merges(config):
        return []
    if getattr(config, "scope", "attention") == "block":
        return [(f"{site.path}.{name}" if name else site.path, module)
                for site in blocks for name, module in site.module.named_modules()]
    return [(f"{path}.{name}" if name else path, module)
            for path, sub, _ in _targets(config, blocks, _merged_kinds(config)) for name, module in sub.named_modules()]


def _merged_kinds(config):
    """The kinds of targets whose tokens are merged (ToDo merges only the queries of self-attention)."""
    return (SELF,) if isinstance(config, ToDoConfig) else None


def _pooled(config, blocks) -> list[tuple[str, nn.Module]]:
    """The self-attention targets whose keys and values ToDo pools."""
    if not (isinstance(config, ToDoConfig) and config.pools):
        return []
    return [(path, sub) for path, sub, _ in _targets(config, blocks, (SELF,))]


# ---- torch.compile -------------------------------------------------------------------------------------------
def forget_compiled(module: nn.Module, *codes) -> None:
    """Drop what torch.compile compiled for the ``forward`` of ``module`` and of every module it holds (and for
    ``codes``, the patch's own hook code), with their continuations after graph breaks: the next compiled call is
    traced again, with the hooks as they are now.

    Dynamo does not guard on empty hook dicts, so code compiled before a patch would keep running unpatched, and
    code compiled after a removal would ignore a later patch. Other models of these classes recompile at their next
    compiled call too; no other code is touched. Nothing to do where dynamo was never imported.
    """
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo import eval_frame

    reset = getattr(eval_frame, "reset_code", None)
    if reset is None:  # a torch without it: every compiled graph of the process, so that none runs stale
        torch.compiler.reset()
        return
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache

        resumed = ContinueExecutionCache.cache
    except (ImportError, AttributeError):  # pragma: no cover - the continuations of another torch
        resumed = {}
    todo = [c for c in {getattr(type(m).forward, "__code__", None) for m in module.modules()} | set(codes) if c]
    seen = set()
    while todo:
        code = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        reset(code)
        todo.extend((resumed.get(code) or {}).values())


def _compiled_in_place(modules) -> str | None:
    """The path of the first of ``(path, module)`` compiled in place (``Module.compile()``), or ``None``."""
    for path, module in modules:
        if module.__dict__.get("_compiled_call_impl") is not None:
            return path
    return None


def _regional_message(path: str, later: bool) -> str:
    return (f"tokenmerge: {path} {'was compiled in place after the patch' if later else 'is compiled in place'} "
            "(Module.compile(), as diffusers' compile_repeated_blocks does): its compiled code runs the patch's hooks "
            "apart from the denoiser's call, whose token grid they need, so the patch cannot work there. Compile "
            "the whole denoiser instead (pipe.transformer.compile() or torch.compile(pipe.transformer)), before or "
            "after the patch")


# ---- apply time ---------------------------------------------------------------------------------------------
def check_apply(model, config, plans) -> None:
    """Refuse what would be wrong or change nothing, before anything is installed.

    ``plans``: ``(site, blocks)`` per denoiser, as ``apply_config`` selected them.
    """
    for site, blocks in plans:
        if not blocks:
            continue
        regional = _compiled_in_place((f"{b.path}.{n}" if n else b.path, m) for b in blocks
                                      for n, m in b.module.named_modules())
        if regional is not None:
            raise ValueError(_regional_message(regional, later=False))
        if isinstance(config, ToDoConfig) and config.pools:
            _check_self_attention(config, blocks)
        targets = {id(sub) for _, sub, _ in _targets(config, blocks, _merged_kinds(config))}
        for path, module in _merged_region(config, blocks):
            registry = module.__dict__.get(REGISTRY_ATTR)
            what = bad_hook(registry) if registry is not None else None
            why = why_refused(config, id(module) in targets)
            if what is not None and why is not None:  # (on a target, it is merged around from inside: caches.py)
                raise ValueError(cache_message(path, what, config, later=False, why=why))


def _check_self_attention(config, blocks) -> None:
    """ToDo pools the keys and values of self-attention: an ``attn1`` that attends to the text changes nothing."""
    cross = []
    for site in blocks:
        for spec in site.targets:
            sub = getattr(site.module, spec.attr, None)
            if spec.kind != SELF or not isinstance(sub, nn.Module):
                continue
            if getattr(site.module, "only_cross_attention", False) or getattr(site.module, "disable_self_attn", False) \
                    or getattr(sub, "is_cross_attention", False):
                cross.append(f"{site.path}.{spec.attr}")
    if cross:
        shown = ", ".join(cross[:4]) + (f" and {len(cross) - 4} more" if len(cross) > 4 else "")
        raise ValueError(
            f"tokenmerge: ToDo pools the keys and values of self-attention, but {shown} attend"
            f"{'s' if len(cross) == 1 else ''} to the text (a UNet built with only_cross_attention, such as the x4 "
            "upscaler's, or LDM's disable_self_attn): ToDo would change nothing there. Use ToMe (apply_patch), "
            "or leave these blocks out (max_downsample=..., blocks=...)")


# ---- the installed patch ------------------------------------------------------------------------------------
class FusedKV:
    """``attn.to_kv`` for a fused self-attention (``fuse_qkv_projections``), which has only ``to_qkv``: the key
    and value rows of ``to_qkv`` (computed by calling it, so LoRA or quantized layers keep working).

    diffusers' fused processor sends keys and values given as ``encoder_hidden_states`` (ToDo's pooled tokens)
    through ``attn.to_kv``. A plain attribute, not a sub-module: the state dict and ``modules()`` are unchanged.
    """

    __slots__ = ("attn",)

    def __init__(self, attn: nn.Module):
        self.attn = attn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.attn.to_qkv(x)
        return qkv[..., qkv.shape[-1] // 3:]  # [q | k | v], three equal parts as the fused processor splits them


def attach(patch) -> None:
    """What an installed patch needs besides its hooks: ``to_kv`` on the self-attentions ToDo pools (so that
    fusing their projections, before or after the patch, keeps working), and the watch on diffusers' hook
    registries of the modules it merges (caches.py)."""
    for _, attn in _pooled(patch.config, patch.blocks):
        if callable(getattr(attn, "fuse_projections", None)) and not hasattr(attn, "to_kv"):
            attn.to_kv = FusedKV(attn)
    targets = {id(getattr(patch.blocks[i].module, bound.spec.attr)): (i, t)
               for i, bounds in enumerate(patch._targets) for t, bound in enumerate(bounds)}
    watch_registries(patch, _merged_region(patch.config, patch.blocks), targets)


def detach(patch) -> None:
    """Undo ``attach``."""
    unwatch(patch)
    for _, attn in _pooled(patch.config, patch.blocks):
        if isinstance(attn.__dict__.get("to_kv"), FusedKV):
            del attn.__dict__["to_kv"]
    patch.__dict__.pop(_GUARD_ATTR, None)


class _Watch:
    """What ``on_call`` checks for one patch: the modules that see merged tokens, the last grid checked and what it
    gave, and whether the patch warned of a call it could not merge."""

    __slots__ = ("region", "hooked", "seen", "grid", "unfit", "warned")

    def __init__(self, patch):
        self.region = _merged_region(patch.config, patch.blocks)
        self.hooked = [(b.path, b.module) for b in patch.blocks] + self.region  # what compiled in place breaks
        self.seen: dict[int, int] = {}  # id of a harmless HookRegistry -> its number of hooks when checked
        self.grid = None
        self.unfit: str | None = None  # why the last grid checked cannot be merged at all (None: it can)
        self.warned = False


def _watch(patch) -> _Watch:
    watch = patch.__dict__.get(_GUARD_ATTR)
    if watch is None:
        watch = patch.__dict__[_GUARD_ATTR] = _Watch(patch)
    return watch


# ---- call time ----------------------------------------------------------------------------------------------
def on_call(patch, grid: tuple[int, ...]) -> str | None:
    """Once per denoiser call, from the denoiser's pre-hook: refuse a cache hook added on a merged sub-module
    since the patch (one dict lookup per such module) and, once per new grid, check that the merge window fits it.

    Returns why no patched level of ``grid`` can be merged (the call then runs unmerged), or ``None``. A level
    where no window fits while others merge is left unmerged (its blocks get no plan), with the same one warning.
    """
    if torch.compiler.is_compiling():
        return None
    watch = _watch(patch)
    regional = _compiled_in_place(watch.hooked)
    if regional is not None:
        raise ValueError(_regional_message(regional, later=True))
    for path, module in watch.region:  # hooks that bypassed the registries' watch (caches.py): refused
        registry = module.__dict__.get(REGISTRY_ATTR)
        if registry is None:
            continue
        hooks = getattr(registry, "hooks", None)
        size = len(hooks) if isinstance(hooks, dict) else 0
        if watch.seen.get(id(registry)) == size:
            continue
        what = bad_hook(registry)
        if what is not None and INSIDE not in hooks:
            raise ValueError(cache_message(path, what, patch.config, later=True,
                                           why="its registry was changed without register_hook"))
        watch.seen[id(registry)] = size
    if grid != watch.grid:
        watch.grid, watch.unfit, partly = grid, *_unfit_levels(patch, grid)
        if partly is not None:
            unmerged(patch, partly)
    return watch.unfit


def unmerged(patch, reason: str) -> None:
    """Warn, once per patch, that a call (or a level of it) runs unmerged, and why."""
    watch = _watch(patch)
    if watch.warned or torch.compiler.is_compiling():
        return
    watch.warned = True
    name = patch.site.path or type(patch.site.module).__name__
    warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on; later calls that cannot be merged run "
                  "unmerged too, without another warning", RuntimeWarning, stacklevel=2)


def _unfit_levels(patch, grid: tuple[int, ...]) -> tuple[str | None, str | None]:
    """``(whole, partly)``: why no patched level of ``grid`` fits a merge window (else ``None``), and why some
    levels do not while others do (else ``None``)."""
    if not _merges(patch.config):
        return None, None
    cfg = patch.config
    sizes = f"sx={cfg.sx}, sy={cfg.sy}" + (f", st={cfg.st}" if cfg.st != 1 else "")
    shape = "x".join(map(str, grid))
    unfit, levels = [], sorted({b.level for b in patch.blocks})
    for level in levels:
        level_grid = tuple(grid)
        for _ in range(level):  # as the UNets downsample: the last two axes halved, rounded up
            level_grid = level_grid[:-2] + tuple(-(-n // 2) for n in level_grid[-2:])
        if num_windows(level_grid, patch.windows) == 0:
            unfit.append(f"{'x'.join(map(str, level_grid))} at downsample {2 ** level}")
    if not unfit:
        return None, None
    if len(unfit) == len(levels):
        where = "" if levels == [0] else f" at each patched level ({', '.join(unfit)})"
        return (f"a call with a {shape} token grid ran unmerged: the merge window ({sizes}) is larger than the "
                f"grid{where}, so no window fits"), None
    return None, (f"a call with a {shape} token grid ran unmerged in some levels: the merge window ({sizes}) is "
                  f"larger than their grids ({', '.join(unfit)}); the other levels merged")
