"""UNets with resolution levels: diffusers' ``UNet2DConditionModel`` / ``ControlNetModel`` (and look-alikes:
SDXL, the video UNets' spatial blocks), and LDM-style ``UNetModel``s (CompVis ``ldm``, Stability ``sgm``, webuis).

Their transformer blocks are diffusers' ``BasicTransformerBlock`` or LDM's look-alike (``attn1`` + ``ff`` +
``norm1``), found in ``transformer_blocks`` lists; the level of a block counts the 2x downsamplings above it.
Temporal blocks of video UNets (``temp_attentions``, ``time_stack``, ``motion_modules``) are left out: their
tokens are frames, not a spatial grid. ControlNet-XS (``UNetControlNetXSModel``) runs a base and a control UNet
side by side: both UNets' transformer blocks are merged, level by level.
"""

from __future__ import annotations

from torch import nn

from .spec import CROSS, MLP, SELF, Arg, BlockSite, Family, LatentGrid, Target, Whole, has, has_list, takes

__all__ = ["DIFFUSERS_UNET", "LDM_UNET", "CONTROLNET_XS", "BASIC_TARGETS", "WHOLE", "transformer_blocks_in",
           "is_transformer_block", "FAMILIES"]

BASIC_TARGETS = (Target("attn1", SELF), Target("attn2", CROSS), Target("ff", MLP))
WHOLE = Whole()  # a basic block returns its hidden states; its other arguments are per image, not per token
_TEMPORAL = ("time_stack", "temp_attentions", "motion_modules", "temporal_transformer")


def is_transformer_block(module: nn.Module) -> bool:
    """Structure shared by diffusers' ``BasicTransformerBlock`` and LDM's: ``attn1`` + ``ff`` + ``norm1``."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in ("attn1", "ff", "norm1"))


def transformer_blocks_in(container: nn.Module, prefix: str, level: int) -> list[BlockSite]:
    """The spatial transformer blocks below ``container``: those held in a ``transformer_blocks`` list."""
    found = []
    for name, module in container.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "transformer_blocks" and is_transformer_block(module):
            if any(p in _TEMPORAL for p in parts):
                continue
            targets = tuple(t for t in BASIC_TARGETS if isinstance(getattr(module, t.attr, None), nn.Module))
            found.append(BlockSite(f"{prefix}.{name}" if prefix else name, module, level, targets, whole=WHOLE,
                                   chunk_attr="_chunk_size"))
    return found


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _diffusers_levels(module: nn.Module, path: str) -> list[BlockSite]:
    blocks, level = [], 0
    for i, block in enumerate(module.down_blocks):
        blocks += transformer_blocks_in(block, _join(path, f"down_blocks.{i}"), level)
        if getattr(block, "downsamplers", None) is not None:
            level += 1
    mid = getattr(module, "mid_block", None)
    if isinstance(mid, nn.Module):
        blocks += transformer_blocks_in(mid, _join(path, "mid_block"), level)
    for i, block in enumerate(getattr(module, "up_blocks", None) or []):
        blocks += transformer_blocks_in(block, _join(path, f"up_blocks.{i}"), level)
        if getattr(block, "upsamplers", None) is not None:
            level -= 1
    return blocks


def _has_child_named(block: nn.Module, word: str) -> bool:
    return any(type(child).__name__ == word for child in block.children())


def _ldm_levels(module: nn.Module, path: str) -> list[BlockSite]:
    blocks, level = [], 0
    for i, block in enumerate(module.input_blocks):
        blocks += transformer_blocks_in(block, _join(path, f"input_blocks.{i}"), level)
        if _has_child_named(block, "Downsample"):
            level += 1
    blocks += transformer_blocks_in(module.middle_block, _join(path, "middle_block"), level)
    for i, block in enumerate(getattr(module, "output_blocks", None) or []):
        blocks += transformer_blocks_in(block, _join(path, f"output_blocks.{i}"), level)
        if _has_child_named(block, "Upsample"):
            level -= 1
    return blocks


DIFFUSERS_UNET = Family(
    "diffusers-unet",
    match=has_list("down_blocks") & has("conv_in"),
    grid=LatentGrid(Arg("sample", fallback_index=0)),
    levels=_diffusers_levels,
    timestep=Arg("timestep", also=("timesteps",)),
    kind="unet",
    description="diffusers UNets and ControlNets: SD 1.x/2.x, SDXL, ControlNet, the video UNets' spatial blocks",
    examples=("unet-sd", "unet-sdxl", "controlnet", "unet-3d", "unet-svd", "unet-motion", "i2vgen-xl",
              "controlnet-union", "sparsectrl", "dreamlite-unet"),
)

LDM_UNET = Family(
    "ldm-unet",
    match=has_list("input_blocks") & has("middle_block"),
    grid=LatentGrid(Arg("x", fallback_index=0)),
    levels=_ldm_levels,
    timestep=Arg("timesteps", also=("timestep", "t")),
    kind="unet",
    description="LDM-style UNetModel (CompVis ldm, Stability sgm, the webuis built on them)",
    examples=("ldm",),
)

# ControlNet-XS: two UNets side by side, level by level
def _xs_levels(module: nn.Module, path: str) -> list[BlockSite]:
    """UNetControlNetXSModel: base and control transformer blocks of each level (the two UNets run side by side,
    at the same resolution)."""
    blocks, level = [], 0
    for i, block in enumerate(module.down_blocks):
        blocks += transformer_blocks_in(block, _join(path, f"down_blocks.{i}"), level)
        if getattr(block, "base_downsamplers", None) is not None:
            level += 1
    blocks += transformer_blocks_in(module.mid_block, _join(path, "mid_block"), level)
    for i, block in enumerate(module.up_blocks):
        blocks += transformer_blocks_in(block, _join(path, f"up_blocks.{i}"), level)
        if getattr(block, "upsamplers", None) is not None:
            level -= 1
    return blocks


CONTROLNET_XS = Family(
    "controlnet-xs",
    match=has("base_conv_in", "ctrl_conv_in", "mid_block") & has_list("down_blocks", "up_blocks")
    & takes("sample", "controlnet_cond"),
    grid=LatentGrid(Arg("sample", fallback_index=0)),
    levels=_xs_levels,
    kind="unet",
    description="ControlNet-XS (UNetControlNetXSModel: the base and control UNets' transformer blocks)",
    examples=("controlnet-xs",),
)

FAMILIES = (DIFFUSERS_UNET, LDM_UNET, CONTROLNET_XS)
