"""Refusals at apply time of combinations that would give wrong results, or silently change nothing, whatever the
technique: each technique's own ``check`` (``technique.py``: ToDo on an ``attn1`` that attends to the text, token
reuse on blocks whose layout it cannot follow, ``kernels="triton"`` without triton, the step cache on a UNet...), a
block (or a sub-module) compiled in place (``compiled.py``; the caches across steps stand it: ``regional``), and a
diffusers cache hook that cannot see whole tokens on a module the patch changes (``caches.py``; the technique says
which modules, ``region``, and why, ``refuses_cache``).
"""

from __future__ import annotations

from .compiled import compiled_in_place, holding, regional_message
from .registries import REGISTRY_ATTR, bad_hook

__all__ = ["check_apply"]


def check_apply(model, config, selected, kind) -> None:
    """Refuse what would be wrong or change nothing, before anything is installed.

    ``selected``: ``(site, blocks)`` per denoiser, as ``apply_config`` selected them; ``kind``: the technique class.
    """
    for site, blocks in selected:
        if not blocks:
            continue
        kind.check(site, blocks, config)
        regional = None if kind.regional else compiled_in_place(holding(site.module, blocks) + [
            (f"{b.path}.{n}", m) for b in blocks for n, m in b.module.named_modules() if n])
        if regional is not None:
            raise ValueError(regional_message(regional, False, kind.name))
        targets = kind.routed(config, blocks)
        for path, module in kind.region(config, blocks):
            registry = module.__dict__.get(REGISTRY_ATTR)
            what = bad_hook(registry) if registry is not None else None
            why = kind.refuses_cache(config, id(module) in targets)
            if what is not None and why is not None:  # (on a target, it is merged around from inside: caches.py)
                raise ValueError(kind.cache_message(path, what, "is enabled", why))
