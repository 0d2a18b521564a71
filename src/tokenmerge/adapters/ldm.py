"""LDM-style UNets (CompVis ``ldm``, Stability ``sgm``, and the webuis built on them).

A ``UNetModel`` with ``input_blocks`` / ``middle_block`` / ``output_blocks`` whose ``SpatialTransformer``s hold
``transformer_blocks`` with ``attn1``/``attn2``/``ff``/``norm1..3`` and ``forward(x, context)``; a resolution
level ends at a child named ``Downsample`` (input side) or ``Upsample`` (output side). Found on the object
itself or at ``model.diffusion_model``, ``diffusion_model`` or ``control_model`` (ControlNet's LDM code).
Matched by structure and class names; none of those repositories is imported.
"""

from __future__ import annotations

from torch import nn

from .base import ArgSpec, DenoiserSite, transformer_blocks_in

__all__ = ["find", "LOCATIONS"]

FAMILY = "ldm-unet"
LOCATIONS = ("model.diffusion_model", "diffusion_model", "control_model")


def _has_child_named(block: nn.Module, word: str) -> bool:
    return any(type(child).__name__ == word for child in block.children())


def find(module: nn.Module, path: str) -> DenoiserSite | None:
    inputs = getattr(module, "input_blocks", None)
    if not isinstance(inputs, nn.ModuleList) or not isinstance(getattr(module, "middle_block", None), nn.Module):
        return None
    sample = ArgSpec.of(module, ("x",), default_index=0)
    if sample is None:
        return None
    site = DenoiserSite(path, module, FAMILY, sample, ArgSpec.of(module, ("timesteps", "timestep", "t")))
    prefix = f"{path}." if path else ""
    level = 0
    for i, block in enumerate(inputs):
        site.blocks += transformer_blocks_in(block, f"{prefix}input_blocks.{i}", level)
        if _has_child_named(block, "Downsample"):
            level += 1
    site.blocks += transformer_blocks_in(module.middle_block, f"{prefix}middle_block", level)
    for i, block in enumerate(getattr(module, "output_blocks", None) or []):
        site.blocks += transformer_blocks_in(block, f"{prefix}output_blocks.{i}", level)
        if _has_child_named(block, "Upsample"):
            level -= 1
    return site
