"""Refusals at apply time of combinations that would give wrong results, or silently change nothing; and which
modules a patch's merged tokens reach (what the guards watch).

- a block (or a sub-module) compiled in place (``compiled.py``);
- ToDo on an ``attn1`` that is a cross-attention (``only_cross_attention``, LDM's ``disable_self_attn``): it would
  change nothing;
- a diffusers cache hook that cannot see whole tokens, on a module the patch merges (``caches.py``): inside a merged
  target, or with ``scope="block"`` on a block (one on a target is merged around from inside its hook chain);
- ``kernels="triton"`` without the triton package.
"""

from __future__ import annotations

from torch import nn

from ..config import ReuseConfig, ToDoConfig
from ..families.spec import CROSS, JOINT, MLP, SELF
from ..merge.kernels import missing
from .caches import REGISTRY_ATTR, bad_hook, cache_message, why_refused
from .compiled import compiled_in_place, regional_message
from .techniques import technique_for

__all__ = ["check_apply", "merged_region", "pooled_attentions", "merges", "routed"]


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
    check = getattr(technique_for(config), "check", None)
    for site, blocks in selected:
        if not blocks:
            continue
        if check is not None:
            check(site, blocks, config)
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
