"""diffusers UNets and ControlNets: ``down_blocks`` / ``mid_block`` / ``up_blocks`` of ``Transformer2DModel``s.

Tested on: ``UNet2DConditionModel`` (SD 1.x, 2.x, SDXL layouts) and ``ControlNetModel``; matched by
structure, so subclasses and look-alikes with the same layout work too. Nothing from diffusers is imported.
"""

from __future__ import annotations

from torch import nn

from .base import ArgSpec, DenoiserSite, transformer_blocks_in

__all__ = ["find"]

FAMILY = "diffusers-unet"


def find(module: nn.Module, path: str) -> DenoiserSite | None:
    down = getattr(module, "down_blocks", None)
    if not isinstance(down, nn.ModuleList) or not hasattr(module, "conv_in"):
        return None
    sample = ArgSpec.of(module, ("sample",), default_index=0)
    if sample is None:
        return None
    site = DenoiserSite(path, module, FAMILY, sample, ArgSpec.of(module, ("timestep", "timesteps")))
    level = 0
    for i, block in enumerate(down):
        site.blocks += transformer_blocks_in(block, _join(path, f"down_blocks.{i}"), level)
        if getattr(block, "downsamplers", None) is not None:
            level += 1
    mid = getattr(module, "mid_block", None)
    if isinstance(mid, nn.Module):
        site.blocks += transformer_blocks_in(mid, _join(path, "mid_block"), level)
    for i, block in enumerate(getattr(module, "up_blocks", None) or []):
        site.blocks += transformer_blocks_in(block, _join(path, f"up_blocks.{i}"), level)
        if getattr(block, "upsamplers", None) is not None:
            level -= 1
    return site


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b
