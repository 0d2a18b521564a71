"""Tencent's Hunyuan image transformers: HunyuanDiT and HunyuanImage 2.1 (layout facts: docs/family-facts.md).

- HunyuanDiT (+ ControlNet): ``blocks`` of self-attention ``attn1`` (rotary on the image rows), cross-attention
  ``attn2`` (rotary on its queries) and ``ff``; the long skips join whole tokens between blocks.
- HunyuanImage 2.1: HunyuanVideo's layout on an image latent: both block kinds' ``attn`` take the image and text
  streams and join them ``[image | text]``; key mask ``(B, 1, 1, N + L)``, rotary on the image rows.
"""

from __future__ import annotations

from .spec import (
                   CROSS,
                   JOINT,
                   MLP,
                   SELF,
                   TEXT_AFTER,
                   TEXT_NONE,
                   Blocks,
                   Family,
                   LatentGrid,
                   Mask,
                   Rotary,
                   Target,
                   block_has,
                   has,
                   has_list,
                   takes,
)

__all__ = ["HUNYUAN_DIT", "HUNYUAN_IMAGE", "FAMILIES"]

_PATCH = ("patch_size", "patch_size")

_HYDIT_ROTARY = Rotary("image_rotary_emb", text=TEXT_NONE)  # (cos, sin) each (N, d), from the pipeline
HUNYUAN_DIT = Family(
    "hunyuan-dit",
    match=has("pos_embed", "time_extra_emb", "text_embedder") & has_list("blocks")
    & takes("encoder_hidden_states_t5", "image_meta_size") & block_has("blocks", "attn1", "attn2", "ff"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("blocks", (Target("attn1", SELF, rotary=_HYDIT_ROTARY, keys=TEXT_NONE),
                              Target("attn2", CROSS, rotary=_HYDIT_ROTARY), Target("ff", MLP)),
                   requires=("attn1", "ff"), chunk_attr="_chunk_size"),),
    batch_pattern=True,
    description="HunyuanDiT 1.x (+ ControlNet)",
    examples=("hunyuan-dit", "hunyuan-dit-controlnet"),
)

_HYIMAGE_ATTN = Target("attn", JOINT, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                       mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER)
HUNYUAN_IMAGE = Family(
    "hunyuan-image",
    match=has("x_embedder", "context_embedder", "time_guidance_embed", "rope")
    & has_list("transformer_blocks", "single_transformer_blocks")
    & block_has("single_transformer_blocks", "attn", "proj_mlp", "act_mlp"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (_HYIMAGE_ATTN, Target("ff", MLP)), requires=("attn", "ff")),
            Blocks("single_transformer_blocks", (_HYIMAGE_ATTN,), requires=("attn", "proj_mlp"))),
    batch_pattern=True,
    description="HunyuanImage 2.1 (+ refiner): HunyuanVideo's double and single blocks on an image",
    examples=("hunyuan-image-2.1",),
)


FAMILIES: tuple = (HUNYUAN_DIT, HUNYUAN_IMAGE)
