"""The CogView line: CogView3-Plus, CogView4 and GLM-Image (layout facts: docs/family-facts.md).

- CogView3-Plus / CogView4 / GLM-Image: ``transformer_blocks`` whose ``attn1`` joins the image and text streams as
  ``[text | image]`` inside the call and returns ``(image, text)``. CogView3-Plus runs its feed-forward on
  ``[text | image]`` (only the image part is merged); CogView4 and GLM-Image call one ``ff`` module twice (image
  rows, then text rows), so it is not merged; their rotary ``(cos, sin)`` ``(N, d)`` covers the image rows only and
  their mask ``(B, L)`` the text only. GLM-Image's key/value cache of condition images sits before the text keys.
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
                   Mask,
                   Rotary,
                   Target,
                   block_has,
                   has,
                   has_list,
                   takes,
)

__all__ = ["COGVIEW3PLUS", "COGVIEW4", "GLM_IMAGE", "FAMILIES"]

_PATCH = ("patch_size", "patch_size")

_COGVIEW = has("patch_embed", "time_condition_embed") & has_list("transformer_blocks") \
    & takes("original_size", "target_size", "crop_coords") \
    & block_has("transformer_blocks", "attn1", "ff", "norm2_context")
_FF_TWICE = ("calls one feed-forward module on the image rows and then on the text rows, so it cannot be merged "
             "around; use merge_mlp=False")
# attn1 joins [text | image] inside; rotary (cos, sin) (N, d) on the image rows; the mask (B, L) covers the text
_COGVIEW4_ATTN = Target("attn1", JOINT, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                        mask=Mask("attention_mask", image=False), keys=TEXT_BEFORE)

COGVIEW3PLUS = Family(
    "cogview3plus",
    match=_COGVIEW & ~has("rope"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (Target("attn1", JOINT, keys=TEXT_BEFORE),
                                          Target("ff", MLP, text=TEXT_BEFORE)), requires=("attn1", "ff")),),
    description="CogView3-Plus (joint [text | image] attention and feed-forward)",
    examples=("cogview3plus",),
)

COGVIEW4 = Family(
    "cogview4",
    match=_COGVIEW & has("rope") & takes("image_rotary_emb"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (_COGVIEW4_ATTN, Target("ff", MLP, refuse="CogView4 " + _FF_TWICE)),
                   requires=("attn1", "ff")),),
    batch_pattern=True,
    description="CogView4 (joint [text | image] attention; the feed-forward is not merged)",
    examples=("cogview4",),
)

GLM_IMAGE = Family(
    "glm-image",
    match=has("image_projector", "time_condition_embed", "prior_token_embedding", "rope")
    & has_list("transformer_blocks")
    & takes("prior_token_id", "target_size") & block_has("transformer_blocks", "attn1", "ff"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (_COGVIEW4_ATTN, Target("ff", MLP, refuse="GLM-Image " + _FF_TWICE)),
                   requires=("attn1", "ff")),),
    batch_pattern=True,
    description="GLM-Image (CogView4's layout; condition images' cached keys pass whole; the feed-forward is not "
                "merged)",
    examples=("glm-image",),
)


FAMILIES: tuple = (COGVIEW3PLUS, COGVIEW4, GLM_IMAGE)
