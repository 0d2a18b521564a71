"""Finding the denoisers in what a user holds (a pipeline, a bare model, an LDM-style wrapper, a compiled model),
the blocks their family patches, and the sub-modules and ``forward`` arguments the records name (``resolve``,
``bind``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..families import Family, match_family, refusal_for
from ..families.predicates import params
from ..families.spec import Arg, BlockSite
from .call import BoundArg

__all__ = ["DenoiserSite", "find_denoisers", "held_modules", "SUPPORTED", "HOLDER_PATHS", "resolve", "bind",
           "bind_whole", "bind_refusals", "select_blocks", "nothing_matched"]

SUPPORTED = (
    "a diffusers pipeline (every denoiser in its components: unet, transformer, controlnet, ...), a bare denoiser "
    "of a registered family (tokenmerge.registered_families(); the README's support table lists them), a "
    "multi-ControlNet, or an LDM-style model (an object with .model.diffusion_model or .diffusion_model, or the "
    "UNetModel itself)"
)

# Where LDM-style wrappers keep their denoiser (CompVis/Stability code and ControlNet's LDM code).
HOLDER_PATHS = ("model.diffusion_model", "diffusion_model", "control_model")


@dataclass
class DenoiserSite:
    """A denoiser, its family and the blocks that family patches in it (possibly none)."""

    path: str
    module: nn.Module
    family: Family
    sample: BoundArg | None
    timestep: BoundArg | None
    blocks: list[BlockSite] = field(default_factory=list)


def bind(arg: Arg, module) -> BoundArg | None:
    """``arg`` resolved against ``module``'s ``forward``: by one of its names, else at its fallback position, else
    by keyword into ``**kwargs``; ``None`` where the signature has no place for it."""
    found = params(module)
    positional = [p.name for p in found if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for name in (arg.name, *arg.also):
        if name in positional:
            return BoundArg(name, positional.index(name), arg.scale, arg.reverse, arg.log_sigma)
        if any(p.name == name for p in found):
            return BoundArg(name, None, arg.scale, arg.reverse, arg.log_sigma)
    if arg.fallback_index is not None and len(positional) > arg.fallback_index:
        return BoundArg(positional[arg.fallback_index], arg.fallback_index, arg.scale, arg.reverse, arg.log_sigma)
    if any(p.kind == p.VAR_KEYWORD for p in found):  # e.g. diffusers' Attention(**cross_attention_kwargs)
        return BoundArg(arg.name, None, arg.scale, arg.reverse, arg.log_sigma)
    return None


def bind_whole(site: BlockSite) -> tuple:
    """A block's arguments that a technique changing its input must follow (its ``Whole`` layout), bound:
    ``(hidden_states, rotary, mask, ((bound, PerToken), ...), (refusing bound, ...))`` (``None``/left out where the
    block takes no such argument)."""
    block, whole = site.module, site.whole
    per_token = tuple((b, p) for b, p in ((bind(Arg(p.name), block), p) for p in whole.per_token) if b is not None)
    return (bind(Arg("hidden_states", also=("x",), fallback_index=0), block),
            bind(Arg(whole.rotary.kwarg, also=whole.rotary.also), block) if whole.rotary is not None else None,
            bind(Arg(whole.mask.kwarg), block) if whole.mask is not None else None, per_token,
            tuple(b for b in (bind(Arg(n), block) for n in whole.refuse_if) if b is not None))


def bind_refusals(site: BlockSite) -> tuple:
    """``((bound argument, reason), ...)``: the block's arguments whose presence refuses its call (``refuse_if``)."""
    return tuple((b, r) for b, r in ((bind(Arg(n), site.module), r) for n, r in site.refuse_if) if b is not None)


def resolve(obj, dotted: str):
    """``obj.<dotted path>``, or ``None`` where a part of the path is missing."""
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _unwrap(module):
    """The model inside a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``), else the module itself."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def site_of(module: nn.Module, path: str, family: Family) -> DenoiserSite | None:
    blocks = family.find_blocks(module, path)
    if blocks is None:
        return None
    return DenoiserSite(path, module, family, bind(family.grid.arg, module), bind(family.timestep, module), blocks)


def _in_module(module: nn.Module, path: str) -> list[DenoiserSite]:
    module = _unwrap(module)
    refused = refusal_for(module)
    if refused is not None:
        raise TypeError(f"tokenmerge cannot patch {path or 'the model'} ({type(module).__name__}): {refused.reason}")
    family = match_family(module)
    if family is not None:
        site = site_of(module, path, family)
        if site is not None:
            return [site]
    nets = getattr(module, "nets", None)  # diffusers MultiControlNetModel
    if isinstance(nets, nn.ModuleList):
        return [s for i, net in enumerate(nets) for s in _in_module(net, f"{path}.nets.{i}" if path else f"nets.{i}")]
    found = []
    for where in HOLDER_PATHS:
        inner = resolve(module, where)
        if isinstance(inner, nn.Module):
            found += _in_module(inner, f"{path}.{where}" if path else where)
    return found


def held_modules(model) -> dict[str, nn.Module]:
    """The modules a model-holding object gives access to: ``{"": model}`` for a module itself, else a
    pipeline's ``components`` (or its ``unet``/``controlnet``/``transformer``/``model`` attributes)."""
    _refuse_class(model)
    if isinstance(model, nn.Module):
        return {"": model}
    components = getattr(model, "components", None)
    if not isinstance(components, dict):
        components = {name: getattr(model, name, None) for name in ("unet", "controlnet", "transformer", "model")}
    return {name: c for name, c in components.items() if isinstance(c, nn.Module)}


def _refuse_class(model) -> None:
    if isinstance(model, type):
        raise TypeError(f"tokenmerge was given the class {model.__module__}.{model.__qualname__}, not a model: "
                        f"pass an instance (a loaded pipeline or model), e.g. {model.__name__}.from_pretrained(...)")


def find_denoisers(model) -> list[DenoiserSite]:
    """The denoisers held by ``model``, each with the blocks its family patches (possibly none)."""
    _refuse_class(model)
    sites = [site for name, module in held_modules(model).items() for site in _in_module(module, name)]
    if not sites:
        raise TypeError(f"tokenmerge cannot patch a {type(model).__name__}: supported are {SUPPORTED}")
    return sites


def select_blocks(site: DenoiserSite, max_downsample: int | None,
                  indices: tuple[int, ...] | None = None) -> list[BlockSite]:
    """The blocks of ``site`` that a ``max_downsample`` setting selects (``None``: the finest level with any),
    then, if ``indices`` is given, those at these positions of that list (negative counts from the end)."""
    if not site.blocks:
        return []
    if max_downsample is None:
        finest = min(b.level for b in site.blocks)
        chosen = [b for b in site.blocks if b.level == finest]
    else:
        chosen = [b for b in site.blocks if b.downsample <= max_downsample]
    if indices is None or not chosen:
        return chosen
    bad = [i for i in indices if not -len(chosen) <= i < len(chosen)]
    if bad:
        raise ValueError(f"blocks {bad} out of range: {site.path or type(site.module).__name__} has "
                         f"{len(chosen)} blocks at the selected levels (indices 0..{len(chosen) - 1})")
    return [chosen[i] for i in sorted({i % len(chosen) for i in indices})]


def nothing_matched(sites: list[DenoiserSite], max_downsample: int | None) -> str:
    """Why ``max_downsample`` selects no block of ``sites``, in words."""
    parts = []
    for site in sites:
        name = site.path or type(site.module).__name__
        levels = sorted({b.downsample for b in site.blocks})
        parts.append(f"{name} has transformer blocks at downsample {levels}" if levels
                     else f"{name} has no transformer blocks")
    hint = "" if max_downsample is None else (
        f"; max_downsample={max_downsample} selects none of them: use max_downsample=None (the finest level "
        "with attention) or a value at least as large as the smallest downsample listed"
    )
    return "no transformer block to merge in: " + "; ".join(parts) + hint
