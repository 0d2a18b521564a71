"""Image transformers of 2025-2026 (layout facts: docs/family-facts.md).

- Flux.2 (dev, Klein): double-stream ``transformer_blocks`` (``attn`` over the two streams, rotary ``(cos, sin)``
  with the text rows first) and single-stream blocks whose ``attn`` is a fused parallel attention + MLP over
  [text, image] (the model concatenates the streams before the first single block): merging around it merges the
  MLP too. The grid comes from ``img_ids`` ``(B, N, 4)`` (t, row, col, l).
- Qwen-Image (+ Edit, 2511, Layered): dual-stream blocks, ``attn`` over [text, image] with the image stream
  separate, image feed-forward ``img_mlp``; rotary ``(image_freqs, text_freqs)`` (complex); the grid from
  ``img_shapes``. Edit's reference-image tokens follow the image's in its stream: they pass whole, as text does.
- SANA: linear self-attention ``attn1`` (ToDo pools its keys and values), cross-attention ``attn2``; the
  feed-forward ``GLUMBConv`` is a convolution over the token grid and cannot take merged tokens.
"""

from __future__ import annotations

from .spec import (
                   CROSS,
                   JOINT,
                   MLP,
                   SELF,
                   TEXT_AFTER,
                   TEXT_BEFORE,
                   Arg,
                   Blocks,
                   Family,
                   IdsGrid,
                   LatentGrid,
                   Mask,
                   Rotary,
                   ShapesGrid,
                   Target,
                   Whole,
                   block_has,
                   config_is,
                   has,
                   has_list,
                   takes,
)

__all__ = ["FLUX2", "QWEN_IMAGE", "SANA", "SANA_SPRINT", "FAMILIES"]

_FLUX2_ROTARY = Rotary("image_rotary_emb", text=TEXT_BEFORE)
_FLUX2_FUSED = ("its single-stream attention computes the feed-forward of every token inside the attention call (one "
                "fused projection, concatenated with the attention's output), which cannot keep only some tokens' "
                "rows")  # (keys="kept" runs the whole block on the recomputed tokens: that works)
FLUX2 = Family(
    "flux2",
    match=has("x_embedder", "single_stream_modulation") & has_list("transformer_blocks", "single_transformer_blocks")
    & takes("img_ids") & block_has("single_transformer_blocks", "attn") & ~block_has("single_transformer_blocks",
                                                                                       "proj_mlp"),
    grid=IdsGrid(Arg("img_ids"), axes=(1, 2)),
    blocks=(
        Blocks("transformer_blocks", (Target("attn", JOINT, rotary=_FLUX2_ROTARY, mask=Mask(text=TEXT_BEFORE),
                                             keys=TEXT_BEFORE),
                                      Target("ff", MLP)), requires=("attn", "ff"),
               whole=Whole(output=1, rotary=_FLUX2_ROTARY, text="encoder_hidden_states", text_output=0)),
        Blocks("single_transformer_blocks", (Target("attn", JOINT, text=TEXT_BEFORE, rotary=_FLUX2_ROTARY,
                                                    mask=Mask(text=TEXT_BEFORE), keys=TEXT_BEFORE,
                                                    reuse=_FLUX2_FUSED),),
               text=TEXT_BEFORE, requires=("attn",), whole=Whole(rotary=_FLUX2_ROTARY)),
    ),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="Flux.2 (dev, Klein): double-stream and fused parallel single-stream blocks",
    examples=("flux2", "flux2-klein", "flux2-klein-ref"),
)

QWEN_IMAGE = Family(
    "qwen-image",
    match=has("img_in", "txt_in", "pos_embed") & has_list("transformer_blocks") & takes("img_shapes")
    & block_has("transformer_blocks", "attn", "img_mlp", "txt_mlp"),
    grid=ShapesGrid(Arg("img_shapes"), rank=2),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, text=TEXT_AFTER, rotary=Rotary("image_rotary_emb", layout="image_text_pair",
                                                             text=TEXT_AFTER), keys=TEXT_BEFORE),
        Target("img_mlp", MLP, text=TEXT_AFTER)), text=TEXT_AFTER, requires=("attn", "img_mlp"),
        whole=Whole(output=1, rotary=Rotary("image_rotary_emb", layout="image_text_pair", text=TEXT_AFTER),
                    per_token=("modulate_index",))),),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="Qwen-Image (+ Edit, Edit-2511, Layered: reference tokens pass whole)",
    examples=("qwen-image", "qwen-image-edit", "qwen-image-edit-2511", "qwen-image-layered", "qwen-image-controlnet"),
)

_SANA_MATCH = has("patch_embed", "caption_projection", "caption_norm") & has_list("transformer_blocks") \
    & block_has("transformer_blocks", "attn1", "attn2", "ff")
_SANA_BLOCKS = (Blocks("transformer_blocks", (
    Target("attn1", SELF), Target("attn2", CROSS),
    Target("ff", MLP, refuse="SANA's GLUMBConv feed-forward is a convolution over the token grid; use "
                             "merge_mlp=False")), requires=("attn1", "ff")),)

SANA = Family(
    "sana",
    match=_SANA_MATCH & ~config_is("guidance_embeds", True),
    grid=LatentGrid(patch=("patch_size", "patch_size")),
    blocks=_SANA_BLOCKS,
    description="SANA 1.x (linear attention; the feed-forward is not merged)",
    examples=("sana", "sana-controlnet"),
)

SANA_SPRINT = Family(  # the same blocks, called with the SCM timestep in 0..1 (1 = noise)
    "sana-sprint",
    match=_SANA_MATCH & config_is("guidance_embeds", True),
    grid=LatentGrid(patch=("patch_size", "patch_size")),
    blocks=_SANA_BLOCKS,
    timestep=Arg("timestep", scale=1000.0),
    description="SANA-Sprint (one- to four-step SANA; 0..1 timesteps)",
    examples=("sana-sprint",),
)

FAMILIES = (FLUX2, QWEN_IMAGE, SANA, SANA_SPRINT,)
