"""More video transformers (layout facts: docs/family-facts.md).

- HunyuanVideo 1.5 (T2V, I2V): double-stream blocks only; ``attn`` takes the video and the context as two streams
  and joins them [video, context] inside; its mask ``(B, L)`` covers the context only (the processor pads it with
  the video's entries), so it passes whole; rotary ``(cos, sin)`` each ``(N, d)``, video rows only.
- EasyAnimate V5.1: ``attn1`` joins [text, video] inside (rotary on the video rows), separate ``ff`` / ``txt_ff``;
  frames go through a 2-D patch embedding one by one (``patch_size`` spatial only).
- Cosmos 1.0 and Cosmos-Predict 2 / 2.5: ``attn1`` self-attention with rotary ``(cos, sin)`` each ``(N, d)``,
  ``attn2`` cross-attention, ``ff``; AdaLN-LoRA modulation (per token with per-frame timesteps) outside the merged
  sub-modules. Cosmos 1.0 (its learnable extra position embedding) is called with EDM's ``c_noise = log(sigma) / 4``,
  Predict 2 / 2.5 with ``sigma / (1 + sigma)`` in 0..1.
- SANA-Video: linear self-attention ``attn1`` with Wan-style rotary ``(1, N, 1, d)``, cross-attention ``attn2``;
  the feed-forward ``GLUMBTempConv`` convolves over the (F, H, W) grid and cannot take merged tokens.
- Kandinsky 5 (regular attention): latent ``(B, F, H, W, C)`` channels last; ``visual_transformer_blocks`` with
  ``self_attention`` (rotary ``(B, N, 1, d/2, 2, 2)``), ``cross_attention`` to the text and ``feed_forward``.
  NABLA sparse attention reorders the tokens into 8x8 blocks and builds a block mask from them: refused.
"""

from __future__ import annotations

from .spec import (CROSS, JOINT, MLP, SELF, TEXT_AFTER, TEXT_BEFORE, TEXT_NONE, Arg, ArgsGrid, Blocks, Family, LatentGrid,
                   Mask, Refused, Rotary, Target, block_has, config_has, config_is, has, has_list, takes)

__all__ = ["HUNYUAN_VIDEO_15", "EASYANIMATE", "COSMOS", "COSMOS_PREDICT2", "SANA_VIDEO", "KANDINSKY5", "LTX2", "ALLEGRO",
           "FAMILIES", "REFUSED"]

LINEAR_ROTARY_TODO = (
    "ToDo cannot pool the keys of this linear attention: rotary positions are applied to every key inside the "
    "attention call (pooled keys would need pooled positions), and the call makes no softmax attention call in which "
    "they could be pooled after that. Use ToMe (apply_patch) on this model")

_VIDEO_ROTARY = Rotary("image_rotary_emb", text=TEXT_NONE)  # (cos, sin) each (N, d): the video's rows only

HUNYUAN_VIDEO_15 = Family(
    "hunyuan-video-1.5",
    match=has("x_embedder", "context_embedder", "context_embedder_2", "image_embedder", "cond_type_embed", "rope")
    & has_list("transformer_blocks") & ~has("single_transformer_blocks")
    & block_has("transformer_blocks", "attn", "ff", "ff_context", "norm1_context"),
    grid=LatentGrid(rank=3, patch=("patch_size_t", "patch_size", "patch_size")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, rotary=_VIDEO_ROTARY, mask=Mask("attention_mask", image=False), keys=TEXT_AFTER),
        Target("ff", MLP)), requires=("attn", "ff")),),
    shared_plan=True,
    description="HunyuanVideo 1.5 (T2V, I2V): double-stream blocks, the context's mask passes whole",
    examples=("hunyuan-video-1.5", "hunyuan-video-1.5-i2v"),
)

_EASYANIMATE = has("proj", "time_proj", "time_embedding", "rope_embedding", "text_proj") \
    & has_list("transformer_blocks") & block_has("transformer_blocks", "attn1", "ff", "norm1", "norm2")

EASYANIMATE = Family(
    "easyanimate",
    match=_EASYANIMATE & block_has("transformer_blocks", "txt_ff", index=-1),
    grid=LatentGrid(rank=3, patch=(1, "patch_size", "patch_size")),
    blocks=(Blocks("transformer_blocks", (Target("attn1", JOINT, rotary=_VIDEO_ROTARY, keys=TEXT_BEFORE),
                                          Target("ff", MLP)),
                   requires=("attn1", "ff", "txt_ff")),),
    shared_plan=True,
    description="EasyAnimate V5.1 (joint [text | video] attention, rotary on the video rows)",
    examples=("easyanimate",),
)

_COSMOS = has("patch_embed", "rope", "time_embed") & has_list("transformer_blocks") & config_has("max_size") \
    & config_has("adaln_lora_dim") & block_has("transformer_blocks", "attn1", "attn2", "ff", "norm3")
_COSMOS_BLOCKS = (Blocks("transformer_blocks", (
    Target("attn1", SELF, rotary=Rotary("image_rotary_emb", text=TEXT_NONE), keys=TEXT_NONE), Target("attn2", CROSS),
    Target("ff", MLP)), requires=("attn1", "ff")),)
_COSMOS_GRID = LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size"))

COSMOS = Family(  # Cosmos 1.0: EDM's preconditioned noise c_noise = log(sigma) / 4
    "cosmos",
    match=_COSMOS & has("learnable_pos_embed"),
    grid=_COSMOS_GRID,
    blocks=_COSMOS_BLOCKS,
    timestep=Arg("timestep", log_sigma=0.25),
    shared_plan=True,
    description="Cosmos 1.0 (text- and video-to-world; EDM log-sigma timesteps)",
    examples=("cosmos", "cosmos-v2w"),
)

COSMOS_PREDICT2 = Family(  # no learnable extra position embedding; timesteps sigma / (1 + sigma) in 0..1
    "cosmos-predict2",
    match=_COSMOS & ~has("learnable_pos_embed"),
    grid=_COSMOS_GRID,
    blocks=_COSMOS_BLOCKS,
    timestep=Arg("timestep", scale=1000.0),
    shared_plan=True,
    description="Cosmos-Predict 2 / 2.5 and Cosmos-Transfer 2.5 (0..1 timesteps)",
    examples=("cosmos-predict2",),
)

SANA_VIDEO = Family(
    "sana-video",
    match=has("patch_embedding", "rope", "caption_projection", "caption_norm") & has_list("transformer_blocks")
    & block_has("transformer_blocks", "attn1", "attn2", "ff") & takes("hidden_states", "timestep")
    & config_has("rope_max_seq_len"),
    grid=LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn1", SELF, rotary=Rotary("rotary_emb", token_axis=1, text=TEXT_NONE)), Target("attn2", CROSS),
        Target("ff", MLP, refuse="SANA-Video's GLUMBTempConv feed-forward convolves over the (frames, height, width) "
                                 "grid of the tokens; use merge_mlp=False")), requires=("attn1", "ff")),),
    shared_plan=True,
    todo=LINEAR_ROTARY_TODO,
    description="SANA-Video (linear attention with 3-D rotary; the feed-forward is not merged)",
    examples=("sana-video",),
)

_KANDINSKY5 = has("visual_embeddings", "visual_rope_embeddings", "text_rope_embeddings", "time_embeddings") \
    & has_list("visual_transformer_blocks", "text_transformer_blocks") \
    & block_has("visual_transformer_blocks", "self_attention", "cross_attention", "feed_forward")

KANDINSKY5 = Family(
    "kandinsky5",
    match=_KANDINSKY5 & ~config_is("attention_type", "nabla"),
    grid=LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size"), axes=(1, 2, 3)),
    blocks=(Blocks("visual_transformer_blocks", (
        Target("self_attention", SELF, rotary=Rotary("rotary_emb", token_axis=1, text=TEXT_NONE), keys=TEXT_NONE),
        Target("cross_attention", CROSS), Target("feed_forward", MLP)), requires=("self_attention", "feed_forward")),),
    shared_plan=True,
    description="Kandinsky 5 (T2V, I2V, T2I; regular attention)",
    examples=("kandinsky5",),
)

ALLEGRO = Family(  # frames flattened into the sequence; 3-D rotary as per-axis tables + per-token positions (1, N)
    "allegro",
    match=has("pos_embed", "adaln_single", "caption_projection") & has_list("transformer_blocks")
    & config_has("sample_frames") & config_has("patch_size_t")
    & block_has("transformer_blocks", "attn1", "attn2", "ff") & takes("image_rotary_emb"),
    grid=LatentGrid(rank=3, patch=("patch_size_t", "patch_size", "patch_size")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn1", SELF, rotary=Rotary("image_rotary_emb", layout="tables_positions", token_axis=-1,
                                            text=TEXT_NONE), keys=TEXT_NONE),
        Target("attn2", CROSS), Target("ff", MLP)), requires=("attn1", "ff")),),
    shared_plan=True,
    description="Allegro (3-D rotary from per-axis tables and per-token positions)",
    examples=("allegro",),
)

# LTX-2: every block carries the video and the audio stream. The video is merged in its self-attention ``attn1``, its
# text cross-attention ``attn2``, the audio-to-video cross-attention (its queries are video tokens, with their own
# rotary rows) and ``ff``; the audio stream and its sub-modules pass whole, and ``video_to_audio_attn`` takes the
# block's unmerged video tokens as keys. Tokens a call appends after the grid's (the condition pipelines' keyframe
# tokens) pass whole, with their rotary rows.
_LTX2_VIDEO_ROTARY = Rotary("query_rotary_emb", text=TEXT_AFTER)  # (cos, sin): (B, N, D) or (B, heads, N, d / 2)
LTX2 = Family(
    "ltx2",
    match=has("proj_in", "audio_proj_in", "rope", "audio_rope") & has_list("transformer_blocks")
    & block_has("transformer_blocks", "attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn")
    & takes("audio_hidden_states", "num_frames", "height", "width"),
    grid=ArgsGrid(("num_frames", "height", "width")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn1", SELF, text=TEXT_AFTER, rotary=_LTX2_VIDEO_ROTARY, keys=TEXT_AFTER),
        Target("attn2", CROSS, text=TEXT_AFTER),
        Target("audio_to_video_attn", CROSS, text=TEXT_AFTER, rotary=_LTX2_VIDEO_ROTARY),
        Target("ff", MLP, text=TEXT_AFTER)), text=TEXT_AFTER, requires=("attn1", "ff", "audio_to_video_attn")),),
    shared_plan=True,
    description="LTX-2 (audio + video): the video merged, the audio stream whole; appended keyframe tokens pass whole",
    examples=("ltx2",),
)

REFUSED = (
    Refused("kandinsky5-nabla", _KANDINSKY5 & config_is("attention_type", "nabla"),
            "Kandinsky 5 with NABLA sparse attention reorders the video tokens into 8x8 blocks and builds a block "
            "mask from their queries and keys; merged tokens break both"),
    Refused("easyanimate-shared-ff", _EASYANIMATE & ~block_has("transformer_blocks", "txt_ff", index=-1),
            "EasyAnimate blocks past mmdit_layers run one feed-forward on the video and then on the text tokens, "
            "which cannot be merged around"),
    Refused("kandinsky6", has("visual_embeddings", "audio_embeddings") & has_list("visual_transformer_blocks")
            & block_has("visual_transformer_blocks", "video_dec_block", "va_cross_attention"),
            "Kandinsky 6 calls its video self-attention, cross-attention and feed-forward as sub-modules of a "
            "container (video_dec_block) inside each fused video/audio block, and tokenmerge targets only a block's "
            "own sub-modules; not supported yet"),
    Refused("kandinsky6-sr", has("visual_embeddings", "visual_rope_embeddings") & has_list("visual_transformer_blocks")
            & config_has("nabla_window"),
            "Kandinsky 6 SR orders its tokens in 8x8 tiles and runs NABLA sparse attention over 64-token blocks with "
            "a block mask made from their queries and keys; merged tokens break both"),
    Refused("minimax-h3", takes("token_tags", "position_ids", "video_indices", "audio_indices")
            & has_list("transformer_blocks"),
            "MiniMax-H3 runs one caller-built sequence of text, audio and video rows at caller-given positions "
            "(video_indices), conditioning and generated video rows mixed: its video tokens are not one grid in "
            "one place"),
    Refused("wan-animate-2", has("patch_embedding") & has_list("blocks") & takes("condition_latents", "kv_cache")
            & block_has("blocks", "self_attn", "cross_attn", "ffn"),
            "Wan-Animate 2 takes per-sample lists of latents padded to seq_len, rotates its queries and keys inside "
            "self-attention by positions computed there from grid_sizes (not per-token rows that could follow the "
            "merge), and caches reference-frame keys and values across calls"),
    Refused("sana-wm", has("x_embedder", "plucker_embedder", "rope") & has_list("blocks") & takes("camera_conditions"),
            "SANA-WM's self-attention (gated-delta linear attention with temporal short convolutions and per-token "
            "camera ray transforms) and its GLUMBConvTemp feed-forward work on the (frames, height, width) grid of "
            "the tokens"),
    Refused("sana-wm-refiner", has("proj_in", "rope") & has_list("transformer_blocks")
            & takes("video_rotary_emb", "kv_cache") & ~takes("num_frames"),
            "The SANA-WM refiner takes packed tokens without their grid (only their rotary tables) and attends over "
            "a key/value cache of earlier chunks with attention sinks"),
)

FAMILIES = (HUNYUAN_VIDEO_15, EASYANIMATE, COSMOS, COSMOS_PREDICT2, SANA_VIDEO, KANDINSKY5, LTX2, ALLEGRO,)
