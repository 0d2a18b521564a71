"""Image transformers that keep the text apart from the image tokens, in every block or in the first ones
(layout facts: docs/family-facts.md).

- AuraFlow: MMDiT ``joint_transformer_blocks`` (text a separate stream), then ``single_transformer_blocks`` on
  ``[register + text | image]``.
- HiDream-I1: each block list entry wraps its block (``.block``); double-stream ``attn1`` joins ``[image | text]``,
  single-stream blocks run on ``[image | text]``; rotary ``(B, S, 1, d/2, 2, 2)`` over the same rows. A non-square
  latent is padded to a fixed token count after the image (``hidden_states_masks``): the padding passes whole, as
  text does.
- PRX: ``attention`` queries the image tokens over ``[text | image]`` keys; rotary ``(B, 1, N, d/2, 2, 2)``.
- NucleusMoE-Image: ``attn`` queries the image tokens over ``[image | text]`` keys; rotary ``(image, text)`` pair;
  its expert-choice MoE feed-forward routes over the whole sequence and is not merged.
- JoyImage-Edit (+ Plus): Qwen-like dual-stream ``double_blocks``; the target image's tokens come first in the image
  stream, the reference images' after them (they pass whole, with their rotary rows).
- Flux 3: image-only ``mode_blocks.image`` (self-attention and feed-forward, parallel), then
  ``single_transformer_blocks`` that join ``[text | image | reference]`` for attention and feed-forward.
"""

from __future__ import annotations

from .spec import (
                   JOINT,
                   MLP,
                   SELF,
                   TEXT_AFTER,
                   TEXT_BEFORE,
                   TEXT_NONE,
                   Arg,
                   Blocks,
                   Family,
                   IdsGrid,
                   LatentGrid,
                   Mask,
                   Rotary,
                   ShapesGrid,
                   Target,
                   block_has,
                   has,
                   has_list,
                   takes,
)

__all__ = ["AURAFLOW", "HIDREAM", "PRX", "NUCLEUS_MOE", "JOYIMAGE_EDIT", "JOYIMAGE_EDIT_PLUS", "FLUX3", "FAMILIES"]

_PATCH = ("patch_size", "patch_size")


# ---- AuraFlow -------------------------------------------------------------------------------------------------
AURAFLOW = Family(
    "auraflow",
    match=has("pos_embed", "time_step_embed", "context_embedder")
    & has_list("joint_transformer_blocks", "single_transformer_blocks")
    & block_has("joint_transformer_blocks", "attn", "ff", "ff_context"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(
        Blocks("joint_transformer_blocks", (Target("attn", JOINT, keys=TEXT_BEFORE), Target("ff", MLP)),
               requires=("attn", "ff")),
        Blocks("single_transformer_blocks", (Target("attn", JOINT, text=TEXT_BEFORE, keys=TEXT_BEFORE),
                                             Target("ff", MLP, text=TEXT_BEFORE)),
               text=TEXT_BEFORE, requires=("attn", "ff")),
    ),
    timestep=Arg("timestep", scale=1000.0),
    description="AuraFlow (MMDiT blocks, then single blocks on [registers + text | image]; 0..1 timesteps)",
    examples=("aura-flow",),
)

# ---- HiDream-I1 -----------------------------------------------------------------------------------------------
# [image | padding | text] everywhere: what follows the image passes whole, its rotary rows and mask entries too
_HIDREAM_ATTN = Target("attn1", JOINT, text=TEXT_AFTER,
                       rotary=Rotary("image_rotary_emb", token_axis=1, text=TEXT_AFTER),
                       mask=Mask("hidden_states_masks", text=TEXT_AFTER), keys=TEXT_AFTER)
_HIDREAM_FF = Target("ff_i", MLP, text=TEXT_AFTER)
HIDREAM = Family(
    "hidream",
    match=has("x_embedder", "t_embedder", "p_embedder", "pe_embedder")
    & has_list("double_stream_blocks", "single_stream_blocks") & takes("encoder_hidden_states_llama3"),
    grid=LatentGrid(Arg("hidden_states", fallback_index=0), patch=_PATCH, axes=(2, 3)),  # (B, C, H, W) only
    blocks=(Blocks("double_stream_blocks", (_HIDREAM_ATTN, _HIDREAM_FF), text=TEXT_AFTER, requires=("attn1", "ff_i"),
                   inner="block"),
            Blocks("single_stream_blocks", (_HIDREAM_ATTN, _HIDREAM_FF), text=TEXT_AFTER, requires=("attn1", "ff_i"),
                   inner="block")),
    timestep=Arg("timesteps", also=("timestep",)),
    batch_pattern=True,
    description="HiDream-I1 (double and single stream blocks, MoE feed-forwards; a non-square latent's padding "
                "passes whole)",
    examples=("hidream",),
)

# ---- PRX, NucleusMoE-Image ------------------------------------------------------------------------------------
PRX = Family(
    "prx",
    match=has("img_in", "txt_in", "pe_embedder") & has_list("blocks")
    & block_has("blocks", "attention", "img_pre_norm"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("blocks", (Target("attention", JOINT, rotary=Rotary("image_rotary_emb", token_axis=2,
                                                                          text=TEXT_NONE),
                                     mask=Mask("attention_mask", image=False), keys=TEXT_BEFORE),),
                   requires=("attention",)),),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="PRX (image queries over [text | image] keys; 0..1 timesteps; the gated MLP is not a sub-module)",
    examples=("prx",),
)

NUCLEUS_MOE = Family(
    "nucleus-moe-image",
    match=has("img_in", "pos_embed", "time_text_embed") & has_list("transformer_blocks") & takes("img_shapes")
    & block_has("transformer_blocks", "attn", "img_mlp", "encoder_proj"),
    grid=ShapesGrid(Arg("img_shapes"), rank=2),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, rotary=Rotary("image_rotary_emb", layout="image_text_pair", text=TEXT_AFTER),
               mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER),
        Target("img_mlp", MLP, refuse="NucleusMoE-Image's expert-choice MoE feed-forward picks tokens over the whole "
                                      "sequence and reads the unmodulated tokens too; use merge_mlp=False")),
        requires=("attn", "img_mlp")),),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="NucleusMoE-Image (image queries over [image | text] keys; the MoE feed-forward is not merged)",
    examples=("nucleus-moe-image",),
)

# ---- JoyImage-Edit (+ Plus) -----------------------------------------------------------------------------------
_JOY = has("img_in", "condition_embedder") & has_list("double_blocks") \
    & block_has("double_blocks", "attn", "img_mlp", "txt_mlp")
_JOY_MLP = Target("img_mlp", MLP, text=TEXT_AFTER)  # [target | references]: the references pass whole

JOYIMAGE_EDIT = Family(
    "joyimage-edit",
    match=_JOY & ~takes("shape_list"),
    grid=LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size")),
    blocks=(Blocks("double_blocks", (
        Target("attn", JOINT, text=TEXT_AFTER, rotary=Rotary("image_rotary_emb", layout="image_text_pair",
                                                             text=TEXT_AFTER), keys=TEXT_AFTER),
        _JOY_MLP), text=TEXT_AFTER, requires=("attn", "img_mlp")),),
    batch_pattern=True,
    description="JoyImage-Edit (target first, reference images pass whole)",
    examples=("joyimage-edit",),
)

JOYIMAGE_EDIT_PLUS = Family(
    "joyimage-edit-plus",
    match=_JOY & takes("shape_list"),
    grid=ShapesGrid(Arg("shape_list"), rank=3),
    blocks=(Blocks("double_blocks", (
        Target("attn", JOINT, text=TEXT_AFTER, rotary=Rotary("image_rotary_emb", text=TEXT_AFTER),
               mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER),
        _JOY_MLP), text=TEXT_AFTER, requires=("attn", "img_mlp")),),
    batch_pattern=True,
    description="JoyImage-Edit-Plus (pre-patchified items: target first, references and padding pass whole)",
    examples=("joyimage-edit-plus",),
)

# ---- Flux 3 ---------------------------------------------------------------------------------------------------
_FLUX3_JOINT = Rotary("image_rotary_emb", text=TEXT_BEFORE)  # (cos, sin) over [text | image | references]
FLUX3 = Family(
    "flux3",
    match=has("x_embedders", "mode_blocks", "pos_embed") & has_list("single_transformer_blocks", "txt_mode_blocks")
    & takes("img_ids", "image_cond_ids"),
    grid=IdsGrid(Arg("img_ids"), axes=(1, 2), refs=Arg("image_cond_ids")),
    blocks=(
        Blocks("mode_blocks.image", (Target("attn", SELF, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                                            keys=TEXT_NONE), Target("ff", MLP)), requires=("attn", "ff")),
        Blocks("single_transformer_blocks", (Target("attn", JOINT, text=TEXT_BEFORE, rotary=_FLUX3_JOINT,
                                                    keys=TEXT_BEFORE),
                                             Target("ff", MLP, text=TEXT_BEFORE)), requires=("attn", "ff")),
    ),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="Flux 3 (image mode blocks, then single blocks on [text | image | references]; 0..1 timesteps)",
    examples=("flux3", "flux3-ref"),
)


FAMILIES: tuple = (AURAFLOW, HIDREAM, PRX, NUCLEUS_MOE, JOYIMAGE_EDIT, JOYIMAGE_EDIT_PLUS, FLUX3)
