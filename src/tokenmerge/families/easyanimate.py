"""EasyAnimate V5.1, and its blocks that share one feed-forward, recognised and refused (layout facts:
docs/family-facts.md).

- EasyAnimate V5.1: ``attn1`` joins [text, video] inside (rotary on the video rows), separate ``ff`` / ``txt_ff``;
  frames go through a 2-D patch embedding one by one (``patch_size`` spatial only).
"""

from __future__ import annotations

from .spec import (
                   JOINT,
                   MLP,
                   TEXT_BEFORE,
                   TEXT_NONE,
                   Blocks,
                   Family,
                   LatentGrid,
                   Refused,
                   Rotary,
                   Target,
                   block_has,
                   has,
                   has_list,
)

__all__ = ["EASYANIMATE", "FAMILIES", "REFUSED"]

_VIDEO_ROTARY = Rotary("image_rotary_emb", text=TEXT_NONE)  # (cos, sin) each (N, d): the video's rows only

_EASYANIMATE = has("proj", "time_proj", "time_embedding", "rope_embedding", "text_proj") \
    & has_list("transformer_blocks") & block_has("transformer_blocks", "attn1", "ff", "norm1", "norm2")

EASYANIMATE = Family(
    "easyanimate",
    match=_EASYANIMATE & block_has("transformer_blocks", "txt_ff", index=-1),
    grid=LatentGrid(rank=3, patch=(1, "patch_size", "patch_size")),
    blocks=(Blocks("transformer_blocks", (Target("attn1", JOINT, rotary=_VIDEO_ROTARY, keys=TEXT_BEFORE),
                                          Target("ff", MLP)),
                   requires=("attn1", "ff", "txt_ff")),),
    batch_pattern=True,
    description="EasyAnimate V5.1 (joint [text | video] attention, rotary on the video rows)",
    examples=("easyanimate",),
)

FAMILIES: tuple = (EASYANIMATE,)

REFUSED: tuple = (
    Refused("easyanimate-shared-ff", _EASYANIMATE & ~block_has("transformer_blocks", "txt_ff", index=-1),
            "EasyAnimate blocks past mmdit_layers run one feed-forward on the video and then on the text tokens, "
            "which cannot be merged around"),
)
