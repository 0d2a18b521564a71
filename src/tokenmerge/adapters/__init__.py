"""Model support as data: each family's adapter says which denoisers and blocks to patch.

Families: diffusers UNets/ControlNets (``diffusers_unet``), diffusers patch transformers: DiT, PixArt, SD3, Flux
(``diffusers_dit``), and LDM-style UNets (``ldm``).

``find_denoisers`` accepts what users hold: a diffusers pipeline (every denoiser in ``components``), a bare
UNet / ControlNet / multi-ControlNet, or an LDM-style object, and raises ``TypeError`` for anything else.
"""

from __future__ import annotations

from torch import nn

from . import diffusers_dit, diffusers_unet, ldm
from .base import ArgSpec, BlockSite, DenoiserSite, is_transformer_block

__all__ = ["ArgSpec", "BlockSite", "DenoiserSite", "find_denoisers", "held_modules", "is_transformer_block", "SUPPORTED"]

SUPPORTED = (
    "a diffusers pipeline (its unet and controlnet components, multi-ControlNet included), "
    "a diffusers UNet2DConditionModel or ControlNetModel, a DiT, PixArt, SD3 or Flux transformer, "
    "or an LDM-style model (CompVis/Stability code: an object with .model.diffusion_model or .diffusion_model, "
    "or the UNetModel itself with input_blocks/middle_block/output_blocks)"
)

_ADAPTERS = (diffusers_unet.find, diffusers_dit.find, ldm.find)


def _resolve(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _in_module(module: nn.Module, path: str) -> list[DenoiserSite]:
    for adapter in _ADAPTERS:
        site = adapter(module, path)
        if site is not None:
            return [site]
    nets = getattr(module, "nets", None)  # diffusers MultiControlNetModel
    if isinstance(nets, nn.ModuleList):
        return [s for i, net in enumerate(nets) for s in _in_module(net, f"{path}.nets.{i}" if path else f"nets.{i}")]
    found = []
    for where in ldm.LOCATIONS:
        inner = _resolve(module, where)
        if isinstance(inner, nn.Module):
            found += _in_module(inner, f"{path}.{where}" if path else where)
    return found


def held_modules(model) -> dict[str, nn.Module]:
    """The modules a model-holding object gives access to: ``{"": model}`` for a module itself, else a
    pipeline's ``components`` (or its ``unet``/``controlnet``/``model`` attributes) that are modules."""
    if isinstance(model, nn.Module):
        return {"": model}
    components = getattr(model, "components", None)
    if not isinstance(components, dict):
        components = {name: getattr(model, name, None) for name in ("unet", "controlnet", "transformer", "model")}
    return {name: c for name, c in components.items() if isinstance(c, nn.Module)}


def find_denoisers(model) -> list[DenoiserSite]:
    """The denoisers held by ``model``, each with its transformer blocks (possibly none)."""
    sites = [site for name, module in held_modules(model).items() for site in _in_module(module, name)]
    if not sites:
        raise TypeError(f"tokenmerge cannot patch a {type(model).__name__}: supported are {SUPPORTED}")
    return sites
