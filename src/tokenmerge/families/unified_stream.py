"""Image transformers that run image and caption tokens in one unified stream (layout facts: docs/family-facts.md).

- Z-Image: ``forward(x=[(C, 1, H, W)] per sample, t, cap_feats=[(L, D)] per sample)``; the noise refiner runs on
  the image tokens (padded with a learned token to a multiple of 32), the main layers on ``[image | padding |
  caption | batch padding]`` with a per-token complex rotary table ``freqs_cis`` ``(B, S, d/2)`` and, when the
  samples' sequences differ in length (a batch of prompts, or guidance's cond + uncond), a key mask ``(B, S)``.
  The image comes first in every sample and all samples have one size, so it is one contiguous grid at 0; the
  padding and caption pass whole. Omni (condition images per sample, ``x`` a list of lists) is refused per call.
- Lumina-Image 2.0: the noise refiner on the image tokens alone, then ``[caption | image]`` joint layers. Its
  attention is called with ``encoder_hidden_states=hidden_states``: both get the merged tokens. When the samples'
  captions differ in length, each sample's image starts at its own offset and a mask is passed: refused.
- Lumina-Next: image-only blocks; the self-attention ``attn1`` is called with the same tokens as queries and keys,
  the per-token rotary table twice (``query_rotary_emb``, ``key_rotary_emb``) and a (B, N) mask, and returns
  per-head outputs (B, N, heads, head_dim) that the block adds to the cross-attention's and projects itself. The
  softmax scale it derives from the sequence length (``base_sequence_length``) follows the merged count.
- ERNIE-Image: ``[image | caption]`` layers that hold the sequence sequence-first (S, B, D); the attention module
  gets it batch-first with a per-token rotary table (B, S, 1, d) and a (B, 1, 1, S) key mask. Attention only: the
  feed-forward takes (S, B, D) and whole-block merging is not declared.
- Krea 2: one ``[text | image]`` sequence from the first block; ``position_ids`` ``(L + N, 3)`` start with the text's
  rows.
- Ideogram 4: one packed ``[left padding | text | image]`` sequence per sample, each token tagged by ``indicator``
  (2: image); the image's rows are found by the tag, their grid by the (offset) position ids.
- Qwen-Image 2.1: one block-causal sequence, the VLM's text with condition images spliced in, then the target
  image's tokens last (raster order); the target is merged with its rotary rows and key masks.
"""

from __future__ import annotations

from .spec import (
                   CROSS,
                   JOINT,
                   MLP,
                   TEXT_AFTER,
                   TEXT_BEFORE,
                   TEXT_NONE,
                   Arg,
                   Blocks,
                   Family,
                   IdsGrid,
                   LatentGrid,
                   Mask,
                   Refused,
                   Rotary,
                   ShapesGrid,
                   Target,
                   Whole,
                   block_has,
                   has,
                   has_list,
                   takes,
)

__all__ = ["Z_IMAGE", "LUMINA2", "LUMINA_NEXT", "ERNIE_IMAGE", "OMNIGEN", "BRIA_FIBO2", "KREA2", "IDEOGRAM4",
           "QWEN_IMAGE_21", "FAMILIES", "REFUSED"]

_Z_ROTARY = Rotary("freqs_cis", token_axis=1, text=TEXT_AFTER)
_Z_TARGETS = (Target("attention", JOINT, text=TEXT_AFTER, rotary=_Z_ROTARY,
                     mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER),
              Target("feed_forward", MLP, text=TEXT_AFTER))
_Z_WHOLE = Whole(rotary=_Z_ROTARY, mask=Mask("attn_mask", text=TEXT_AFTER), per_token=("noise_mask",))

Z_IMAGE = Family(
    "z-image",
    match=has_list("noise_refiner", "context_refiner", "layers") & has("all_x_embedder", "cap_embedder")
    & ~has_list("control_layers") & takes("cap_feats"),
    grid=LatentGrid(Arg("x", fallback_index=0), rank=2, patch=(Arg("patch_size"), Arg("patch_size"))),
    blocks=(Blocks("noise_refiner", _Z_TARGETS, text=TEXT_AFTER, requires=("attention", "feed_forward"),
                   whole=_Z_WHOLE),
            Blocks("layers", _Z_TARGETS, text=TEXT_AFTER, requires=("attention", "feed_forward"), whole=_Z_WHOLE)),
    timestep=Arg("t", scale=1000.0, reverse=True),  # the pipeline passes (1000 - t) / 1000: 0 = noise
    batch_pattern=True,
    description="Z-Image (Turbo, Base): noise refiner and unified [image | caption] layers",
    examples=("z-image",),
)

_L_ROTARY = Rotary("image_rotary_emb", token_axis=1, text=TEXT_BEFORE)
_L_TARGETS = (Target("attn", JOINT, text=TEXT_BEFORE, rotary=_L_ROTARY, keys=TEXT_BEFORE,
                     same=("encoder_hidden_states",)),
              Target("feed_forward", MLP, text=TEXT_BEFORE))
_L_WHOLE = Whole(rotary=_L_ROTARY)
_L_OFFSETS = (("attention_mask",
               "the samples' captions differ in length (Lumina2 passes a mask only then), so each sample's image "
               "starts at its own offset in the joint sequence, which one merge cannot follow; call the model with "
               "captions of one length (Lumina2Pipeline calls it once per prompt, cond and uncond apart)"),)

LUMINA2 = Family(
    "lumina2",
    match=has("rope_embedder", "time_caption_embed") & has_list("noise_refiner", "context_refiner", "layers"),
    grid=LatentGrid(patch=("patch_size", "patch_size")),
    blocks=(Blocks("noise_refiner", _L_TARGETS, requires=("attn", "feed_forward"), whole=_L_WHOLE),
            Blocks("layers", _L_TARGETS, text=TEXT_BEFORE, requires=("attn", "feed_forward"), whole=_L_WHOLE,
                   refuse_if=_L_OFFSETS)),
    timestep=Arg("timestep", scale=1000.0, reverse=True),  # the pipeline passes 1 - t / 1000: 0 = noise
    batch_pattern=True,
    description="Lumina-Image 2.0: noise refiner and joint [caption | image] layers",
    examples=("lumina2",),
)

_LN_ROTARY = Rotary("query_rotary_emb", token_axis=1, text=TEXT_NONE, same=("key_rotary_emb",))
_LN_MASK = Mask("attention_mask", text=TEXT_NONE)

LUMINA_NEXT = Family(
    "lumina-next",
    match=has("patch_embedder", "time_caption_embed") & has_list("layers")
    & takes("encoder_mask", "image_rotary_emb"),
    grid=LatentGrid(patch=("patch_size", "patch_size")),
    blocks=(Blocks("layers", (Target("attn1", JOINT, text=TEXT_NONE, rotary=_LN_ROTARY, mask=_LN_MASK,
                                     keys=TEXT_NONE, same=("encoder_hidden_states",), per_head=True),
                              Target("feed_forward", MLP, text=TEXT_NONE)),
                   requires=("attn1", "attn2", "feed_forward"),
                   whole=Whole(rotary=Rotary("image_rotary_emb", token_axis=1, text=TEXT_NONE), mask=_LN_MASK)),),
    timestep=Arg("timestep", scale=1000.0, reverse=True),  # the pipeline passes 1 - t / 1000: 0 = noise
    batch_pattern=True,
    description="Lumina-Next (LuminaNextDiT2DModel): image blocks with self- and cross-attention",
    examples=("lumina-next",),
)

_E_ROTARY = Rotary("image_rotary_emb", token_axis=1, text=TEXT_AFTER)

ERNIE_IMAGE = Family(
    "ernie-image",
    match=has("x_embedder", "pos_embed", "adaLN_modulation") & has_list("layers")
    & takes("text_bth", "text_lens"),
    grid=LatentGrid(patch=("patch_size", "patch_size")),
    blocks=(Blocks("layers", (Target("self_attention", JOINT, text=TEXT_AFTER, rotary=_E_ROTARY,
                                     mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER),),
                   text=TEXT_AFTER, requires=("self_attention", "mlp"), seq_first=True),),
    timestep=Arg("timestep"),
    batch_pattern=True,
    description="ERNIE-Image: sequence-first [image | caption] layers (attention only)",
    examples=("ernie-image",),
)

# OmniGen: [condition (text with input-image latents spliced in) | time token | image], image last
_O_ROTARY = Rotary("image_rotary_emb", token_axis=-2, text=TEXT_BEFORE)
_O_MASK = Mask("attention_mask", text=TEXT_BEFORE)

OMNIGEN = Family(
    "omnigen",
    match=has("patch_embedding", "embed_tokens", "time_token") & has_list("layers")
    & takes("input_ids", "input_img_latents"),
    grid=LatentGrid(patch=("patch_size", "patch_size")),
    blocks=(Blocks("layers", (Target("self_attn", JOINT, text=TEXT_BEFORE, rotary=_O_ROTARY, mask=_O_MASK,
                                     keys=TEXT_BEFORE, same=("encoder_hidden_states",),
                                     reuse="its attention reshapes its output to its input's token count"),
                              Target("mlp", MLP, text=TEXT_BEFORE)),
                   text=TEXT_BEFORE, requires=("self_attn", "mlp"), whole=Whole(rotary=_O_ROTARY, mask=_O_MASK)),),
    timestep=Arg("timestep", scale=1000.0),  # 0..1, 1 = noise (its scheduler's num_train_timesteps is 1)
    batch_pattern=True,
    description="OmniGen: one Phi-3 sequence [condition | time token | image]; the image merged, its (S, S) mask "
                "rows and columns and its rotary rows with it",
    examples=("omnigen",),
)

# Bria FIBO 2: Z-Image's blocks. The noise refiner runs on [image | context images]; the layers on [gist | image |
# context images], with a per-token noise_mask (1 on the image) choosing each token's modulation. A call whose
# prompts get different gist counts puts the gist last instead and passes an attn_mask: refused.
_F_REFINER = (Target("attention", JOINT, text=TEXT_NONE, rotary=Rotary("freqs_cis", token_axis=1, text=TEXT_NONE),
                     keys=TEXT_NONE),
              Target("feed_forward", MLP, text=TEXT_NONE))
_F_ROTARY = Rotary("freqs_cis", token_axis=1, text=TEXT_BEFORE)
_F_LAYERS = (Target("attention", JOINT, text=TEXT_BEFORE, rotary=_F_ROTARY, keys=TEXT_BEFORE),
             Target("cross_attention", CROSS, text=TEXT_BEFORE),
             Target("feed_forward", MLP, text=TEXT_BEFORE))
_F_GIST_LAST = (("attn_mask",
                 "the prompts of this call get different numbers of gist tokens, so Bria FIBO 2 puts them after the "
                 "image, padded and masked, instead of before it; call the model with prompts of similar length "
                 "(BriaFibo2Pipeline calls it once per prompt batch, cond and uncond apart)"),)

BRIA_FIBO2 = Family(
    "bria-fibo2",
    match=has("perceiver", "x_embedder") & has_list("noise_refiner", "layers") & takes("context_latents"),
    grid=LatentGrid(patch=("patch_size", "patch_size"), refs=Arg("context_latents")),
    blocks=(Blocks("noise_refiner", _F_REFINER, requires=("attention", "feed_forward"),
                   whole=Whole(rotary=_F_REFINER[0].rotary, mask=Mask("noise_mask", tokens=True))),
            Blocks("layers", _F_LAYERS, text=TEXT_BEFORE, requires=("attention", "feed_forward"),
                   whole=Whole(rotary=_F_ROTARY, mask=Mask("noise_mask", text=TEXT_BEFORE, tokens=True)),
                   refuse_if=_F_GIST_LAST)),
    timestep=Arg("timestep", scale=1000.0),  # 0..1, 1 = noise
    batch_pattern=True,
    description="Bria FIBO 2: noise refiner on [image | edit images], layers on [gist | image | edit images]",
    examples=("bria-fibo2",),
)

# ---- Krea 2 ---------------------------------------------------------------------------------------------------
KREA2 = Family(
    "krea2",
    match=has("text_fusion", "rotary_emb", "img_in", "txt_in") & has_list("transformer_blocks")
    & takes("position_ids", "encoder_attention_mask") & block_has("transformer_blocks", "attn", "ff"),
    grid=IdsGrid(Arg("position_ids"), axes=(1, 2), leading=Arg("encoder_hidden_states")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, text=TEXT_BEFORE, rotary=Rotary("image_rotary_emb", text=TEXT_BEFORE),
               mask=Mask("attention_mask", text=TEXT_BEFORE), keys=TEXT_BEFORE),
        Target("ff", MLP, text=TEXT_BEFORE)), text=TEXT_BEFORE, requires=("attn", "ff")),),
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="Krea 2 (one [text | image] sequence; 0..1 timesteps)",
    examples=("krea2",),
)

# ---- Ideogram 4 ----------------------------------------------------------------------------------------------
# One packed sequence per sample from the input on, tagged per token: [left padding | text | image] (the pipeline's
# layout; the unconditional transformer gets the image alone). The image's rows are those tagged 2; their position
# ids (t, h, w) are offset by 65536 (the span is what counts). Rotary (cos, sin) (B, S, d) and the segment mask
# (B, 1, S, S), made inside the call, are indexed like the tokens.
_I4_ROTARY = Rotary("image_rotary_emb", text=TEXT_BEFORE)
_I4_MASK = Mask("attention_mask", text=TEXT_BEFORE)

IDEOGRAM4 = Family(
    "ideogram4",
    match=takes("indicator", "segment_ids", "position_ids") & has_list("layers")
    & block_has("layers", "attention", "feed_forward"),
    grid=IdsGrid(Arg("position_ids"), axes=(1, 2), image_axis=None, tag=Arg("indicator"), tag_value=2),
    blocks=(Blocks("layers", (
        Target("attention", JOINT, text=TEXT_BEFORE, rotary=_I4_ROTARY, mask=_I4_MASK, keys=TEXT_BEFORE),
        Target("feed_forward", MLP, text=TEXT_BEFORE)), text=TEXT_BEFORE, requires=("attention", "feed_forward"),
        whole=Whole(rotary=_I4_ROTARY, mask=_I4_MASK, per_token=("adaln_input",))),),
    timestep=Arg("timestep", scale=1000.0, reverse=True),  # model time 0..1, 0 = noise
    batch_pattern=True,
    description="Ideogram 4 (one packed [text | image] sequence tagged per token; conditional and unconditional "
                "transformers)",
    examples=("ideogram4",),
)

# ---- Qwen-Image 2.1 -------------------------------------------------------------------------------------------
# One single-stream sequence from the first block: the VLM's text with condition images spliced in (each image slot
# expanded to its 2x2 latent tokens), then the target image's tokens in raster order, last. The default processor
# runs the block-causal prefill as one SDPA call per prefix segment plus one for the target rows, over a (B, S) key
# mask ``key_valid``; a prefix KV cache holds the prefix's keys, which the target never changes (causal).
_Q21_MASK = Mask("attention_mask", text=TEXT_BEFORE, same=("key_valid",))

QWEN_IMAGE_21 = Family(
    "qwen-image-2.1",
    match=has("img_in", "txt_in", "modulation") & has_list("transformer_blocks") & takes("img_mask", "img_shapes"),
    grid=ShapesGrid(Arg("img_shapes"), rank=2, last=True),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, text=TEXT_BEFORE, rotary=Rotary("rotary_emb", text=TEXT_BEFORE), mask=_Q21_MASK),
        Target("img_mlp", MLP, text=TEXT_BEFORE)), text=TEXT_BEFORE, requires=("attn", "img_mlp")),),
    timestep=Arg("timestep", scale=1000.0),  # 0..1, 1 = noise
    batch_pattern=True,
    todo_refused="its attention processor splits the block-causal prefill into one attention call per prefix segment, "
         "most of which hold no image keys to pool; use ToMe (apply_patch)",
    description="Qwen-Image 2.1 (one block-causal [text and condition images | target image] sequence; the "
                "target merged, its key mask and rotary rows with it; prefix KV cache)",
    examples=("qwen-image-2.1",),
)


FAMILIES: tuple = (Z_IMAGE, LUMINA2, LUMINA_NEXT, ERNIE_IMAGE, OMNIGEN, BRIA_FIBO2, KREA2, IDEOGRAM4, QWEN_IMAGE_21)

REFUSED: tuple = (
    Refused("z-image-controlnet", has_list("control_layers", "noise_refiner") & has("cap_embedder")
            & takes("control_context"),
            "Z-Image's ControlNet runs its control blocks on the control image's tokens added to the transformer's "
            "unified sequence and returns a residual per transformer layer over that whole sequence; merging it is "
            "not supported yet (patch the Z-Image transformer it feeds, which is merged)"),
)
