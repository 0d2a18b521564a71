"""Image transformers over patch tokens of 2022-2024: DiT, PixArt-alpha/Sigma, SD3 (MMDiT) and Flux.1.

- DiT / PixArt (``DiTTransformer2DModel``, ``PixArtTransformer2DModel``, the patched ``Transformer2DModel`` of
  older diffusers, and Latte's spatial blocks): ``pos_embed`` + ``transformer_blocks`` of basic blocks.
- SD3 / SD3.5: ``pos_embed`` + ``transformer_blocks`` of joint blocks: ``attn`` over image and text (the text a
  separate stream), ``ff``, and SD3.5's image-only ``attn2``.
- Flux.1 and look-alikes (Chroma, Bria, LongCat-Image, Ovis-Image): ``x_embedder`` + double-stream
  ``transformer_blocks`` + single-stream ``single_transformer_blocks`` whose attention sees [text, image];
  rotary positions from ``img_ids`` (text rows first), so one merge pattern serves the batch.
"""

from __future__ import annotations

import dataclasses

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
                   Target,
                   Whole,
                   block_has,
                   config_has,
                   has,
                   takes,
)
from .unet import BASIC_TARGETS, WHOLE

__all__ = ["DIT", "MMDIT", "FLUX", "FAMILIES"]

_PATCH = ("patch_size", "patch_size")
JOINT_REFUSES_TODO = (
    "ToDo cannot patch joint attention over image and text tokens (SD3/Flux and their kin), whose keys and values "
    "are made inside one attention call: pooling the image tokens there would pool their queries too. Use ToMe "
    "(apply_patch) on this model")

DIT = Family(
    "diffusers-dit",
    match=config_has("patch_size", int) & has("pos_embed") & block_has("transformer_blocks", "attn1", "ff", "norm1")
    & ~config_has("patch_size_t"),  # Allegro (allegro.py): frames in the sequence, its own rotary layout
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", BASIC_TARGETS, requires=("attn1", "ff", "norm1"), whole=WHOLE,
                   chunk_attr="_chunk_size"),),
    description="DiT, PixArt-alpha/Sigma (and Latte's spatial blocks)",
    examples=("dit", "pixart", "latte"),
)

_SPLITS = ("its joint attention splits its output at its input's image token count, so it cannot return only some "
           "tokens' rows")  # (keys="kept" runs the whole block on the recomputed tokens: that works)
MMDIT = Family(
    "diffusers-mmdit",
    match=config_has("patch_size", int) & has("pos_embed") & block_has("transformer_blocks", "attn", "ff")
    & ~has("single_transformer_blocks"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (Target("attn", JOINT, keys=TEXT_AFTER, reuse=_SPLITS),
                                          Target("attn2", SELF, keys=TEXT_NONE), Target("ff", MLP)),
                   requires=("attn", "ff"), chunk_attr="_chunk_size",
                   # blocks return (text, image); the last one's text is None (context_pre_only)
                   whole=Whole(output=1, text="encoder_hidden_states", text_output=0)),),
    description="Stable Diffusion 3 / 3.5 (MMDiT)",
    examples=("sd3", "sd3.5", "sd3-controlnet"),
)

_FLUX_ROTARY = Rotary("image_rotary_emb", text=TEXT_BEFORE)
_FLUX_MASK = Mask("attention_mask", text=TEXT_BEFORE)  # Chroma, Bria-Fibo: (B, 1, S, S) over [text, image]
_FLUX_WHOLE = Whole(output=1, rotary=_FLUX_ROTARY, mask=_FLUX_MASK,  # blocks return (text, image)
                    text="encoder_hidden_states", text_output=0)
FLUX = Family(
    "diffusers-flux",
    match=has("x_embedder", "single_transformer_blocks", "transformer_blocks") & takes("img_ids")
    & block_has("single_transformer_blocks", "attn", "proj_mlp") & ~config_has("time_theta"),
    grid=IdsGrid(Arg("img_ids"), axes=(1, 2)),
    blocks=(
        Blocks("transformer_blocks", (Target("attn", JOINT, rotary=_FLUX_ROTARY, mask=_FLUX_MASK, keys=TEXT_BEFORE),
                                      Target("ff", MLP)),
               requires=("attn", "ff"), whole=_FLUX_WHOLE),
        Blocks("single_transformer_blocks", (Target("attn", JOINT, text=TEXT_BEFORE, rotary=_FLUX_ROTARY,
                                                    mask=_FLUX_MASK, keys=TEXT_BEFORE),),
               text=TEXT_BEFORE, requires=("attn", "proj_mlp"), whole=_FLUX_WHOLE,
               pointwise=(Target("proj_mlp", MLP, text=TEXT_BEFORE), Target("proj_out", MLP, text=TEXT_BEFORE))),
    ),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="Flux.1 (dev, schnell, Fill, Kontext: reference tokens pass whole) and kin: Chroma, Bria, Bria-Fibo, "
                "LongCat-Image, Ovis-Image",
    examples=("flux", "flux-schnell", "flux-fill", "flux-kontext", "longcat-image", "ovis-image", "chroma",
              "flux-controlnet", "flux-controlnet-union"),
)
# Bria 3.2 and Bria-Fibo: Flux.1's layout, but their pipelines call them with the scheduler's timesteps (0..1000)
BRIA = dataclasses.replace(
    FLUX, name="diffusers-bria", match=has("x_embedder", "single_transformer_blocks", "transformer_blocks")
    & takes("img_ids") & block_has("single_transformer_blocks", "attn", "proj_mlp") & config_has("time_theta"),
    timestep=Arg("timestep"),
    description="Bria 3.2, Bria-Fibo: Flux.1's layout, timesteps on 0..1000", examples=("bria", "bria-fibo"))

FAMILIES = (DIT, MMDIT, BRIA, FLUX,)
