"""Refusals at apply time of combinations that would give wrong results, or silently change nothing; and which
modules a patch's merged tokens reach (what the guards watch).

- a block (or a sub-module) compiled in place (``compiled.py``);
- ToDo on an ``attn1`` that is a cross-attention (``only_cross_attention``, LDM's ``disable_self_attn``): it would
  change nothing;
- a diffusers cache hook that cannot see whole tokens, on a module the patch merges (``caches.py``): inside a merged
  target, or with ``scope="block"`` on a block (one on a target is merged around from inside its hook chain);
- ``kernels="triton"`` without the triton package;
- token reuse on blocks whose layout it cannot follow, and attention backends that make no SDPA call (ToDo's are
  refused when its targets are bound, ``techniques/todo.py``).
"""

from __future__ import annotations

from torch import nn

from ..config import ReuseConfig, ToDoConfig
from ..families.spec import CROSS, JOINT, MLP, SELF, TEXT_BEFORE, TEXT_NONE, Arg
from ..merge.kernels import missing
from .attention import backend_refusal
from .caches import REGISTRY_ATTR, bad_hook, cache_message, why_refused
from .compiled import compiled_in_place, regional_message
from .discover import bind, resolve

__all__ = ["check_apply", "check_reuse", "merged_region", "pooled_attentions", "merges", "routed"]


def merges(config) -> bool:
    """Whether the config can change tokens at all (ToMe, ToDo's query merging, token reuse below fraction 1)."""
    if isinstance(config, ReuseConfig):
        return config.reuses
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


def merged_targets(config, blocks) -> list[tuple[str, nn.Module]]:
    """The targets whose tokens are merged (ToDo merges only the queries of self-attention)."""
    kinds = (SELF,) if isinstance(config, ToDoConfig) else None
    return [(path, sub) for path, sub, _ in _targets(config, blocks, kinds)]


def routed(config, blocks) -> dict[int, tuple[int, int]]:
    """``{id(module): (block, target)}`` of the modules whose diffusers cache hooks can run above the technique's
    own (``caches.route``): ToMe's and ToDo's targets (target ``t`` of block ``i``: the ``t``-th it hooks), token
    reuse's blocks (target -1); none with ``scope="block"``."""
    if isinstance(config, ReuseConfig):
        return {id(site.module): (i, -1) for i, site in enumerate(blocks)}
    if getattr(config, "scope", "attention") == "block":
        return {}
    found = {}
    for i, site in enumerate(blocks):
        for t, (_, sub, _) in enumerate(_targets(config, [site])):
            found[id(sub)] = (i, t)
    return found


def merged_region(config, blocks) -> list[tuple[str, nn.Module]]:
    """Every module that sees changed tokens: the merged targets and everything inside them (with
    ``scope="block"`` and token reuse: the blocks themselves, whose input changes before any hook of theirs runs)."""
    if not merges(config):
        return []
    if getattr(config, "scope", "attention") == "block" or isinstance(config, ReuseConfig):
        return [(f"{site.path}.{name}" if name else site.path, module)
                for site in blocks for name, module in site.module.named_modules()]
    return [(f"{path}.{name}" if name else path, module)
            for path, sub in merged_targets(config, blocks) for name, module in sub.named_modules()]


def pooled_attentions(config, blocks) -> list[nn.Module]:
    """The self-attention targets whose keys and values ToDo pools."""
    if not (isinstance(config, ToDoConfig) and config.pools):
        return []
    return [sub for _, sub, _ in _targets(config, blocks, (SELF,))]


def check_apply(model, config, selected) -> None:
    """Refuse what would be wrong or change nothing, before anything is installed.

    ``selected``: ``(site, blocks)`` per denoiser, as ``apply_config`` selected them.
    """
    if getattr(config, "kernels", "torch") == "triton" and missing() is not None:
        raise ValueError(f"tokenmerge: kernels='triton' cannot run here: {missing()}; use kernels='torch'")
    for site, blocks in selected:
        if not blocks:
            continue
        if isinstance(config, ReuseConfig):
            check_reuse(site, blocks, config)
        regional = compiled_in_place((f"{b.path}.{n}" if n else b.path, m) for b in blocks
                                     for n, m in b.module.named_modules())
        if regional is not None:
            raise ValueError(regional_message(regional, later=False))
        if isinstance(config, ToDoConfig) and config.pools:
            if site.family.todo_refused is not None:
                raise ValueError(f"tokenmerge: {site.path or type(site.module).__name__} ({site.family.name}): "
                                 f"{site.family.todo_refused}")
            _check_self_attention(blocks)
        targets = routed(config, blocks) if isinstance(config, ReuseConfig) else \
            {id(sub) for _, sub in merged_targets(config, blocks)}
        for path, module in merged_region(config, blocks):
            registry = module.__dict__.get(REGISTRY_ATTR)
            what = bad_hook(registry) if registry is not None else None
            why = why_refused(config, id(module) in targets)
            if what is not None and why is not None:  # (on a target, it is merged around from inside: caches.py)
                raise ValueError(cache_message(path, what, config, later=False, why=why))


def _check_self_attention(blocks) -> None:
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


def check_reuse(site, blocks, config) -> None:
    """Refuse, with the reason, a denoiser whose blocks token reuse cannot follow."""
    name = f"{site.path or type(site.module).__name__} ({site.family.name})"
    if site.timestep is None:
        raise TypeError(f"tokenmerge: {name} takes no timestep argument, which token reuse needs to tell the "
                        "denoising steps apart")
    for block in blocks:
        if block.whole is None:
            raise ValueError(f"tokenmerge: token reuse needs to know where {block.path} returns its image tokens "
                             f"(its family {site.family.name} declares no whole-block layout), so it cannot "
                             "patch this model")
        if block.seq_first:
            raise ValueError(f"tokenmerge: token reuse does not support the sequence-first blocks of {name}")
        if not any(t.kind in (SELF, JOINT) for t in block.targets):
            raise ValueError(f"tokenmerge: {block.path} declares no attention over its image tokens, which token "
                             "reuse needs")
        for spec in block.targets:
            if spec.refuse is not None:  # a sub-module that mixes tokens (a convolution over the grid, MoE routing)
                raise ValueError(f"tokenmerge: token reuse cannot patch {block.path}: its {spec.attr} mixes tokens "
                                 f"outside attention ({spec.refuse})")
            if spec.reuse is not None and config.keys == "fresh":
                raise ValueError(f"tokenmerge: token reuse with keys='fresh' cannot patch {block.path}: "
                                 f"{spec.reuse}; keys='cached' runs the whole block on the recomputed tokens")
            sub = resolve(block.module, spec.attr)
            why = backend_refusal(sub, "token reuse") if spec.kind in (SELF, JOINT) and isinstance(sub, nn.Module) \
                else None
            if why is not None:
                raise ValueError(f"tokenmerge: {block.path}.{spec.attr}: {why}")
    if config.text:
        _check_text(site, blocks)


def _check_text(site, blocks) -> None:
    """``text=True``: refuse blocks none of which has a separate text stream whose rows lead its rotary table."""
    streams = [b for b in blocks if b.whole.text is not None and bind(Arg(b.whole.text), b.module) is not None]
    if not streams:
        raise ValueError(f"tokenmerge: token reuse's text=True recomputes part of a separate text stream, and the "
                         f"blocks of {site.family.name} have none that it knows of (Flux.1 and its kin do); leave "
                         "text=False")
    for b in streams:
        rotary = b.whole.rotary
        if rotary is not None and (rotary.layout != "tensor" or rotary.text != TEXT_BEFORE):
            raise ValueError(f"tokenmerge: token reuse's text=True cannot follow the rotary table of {b.path} "
                             "(its text rows do not lead one tensor); leave text=False")
        if any(t.kind in (SELF, JOINT) and t.keys not in (TEXT_BEFORE, TEXT_NONE) for t in b.targets):
            raise ValueError(f"tokenmerge: token reuse's text=True recomputes text rows that lead the attention's "
                             f"keys, and {b.path}'s attention puts the text after the image; leave text=False")
