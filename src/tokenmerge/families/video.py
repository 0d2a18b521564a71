"""The Wan, HunyuanVideo, CogVideoX, LTX and Mochi video lines, over (frames, height, width) token grids (layout
facts: docs/family-facts.md). Other video lines have a module each (``cosmos``, ``kandinsky``, ``sana_video``,
``easyanimate``, ``allegro``).

- Wan 2.1 / 2.2 (T2V, I2V, TI2V) and its kin with the same block layout (VACE, Animate, SkyReels-V2, ChronoEdit):
  latent ``(B, C, F, H, W)``, ``patch_size=(1, 2, 2)``, ``blocks`` of self-attention ``attn1`` (rotary
  ``(cos, sin)`` each ``(1, N, 1, d)``, video rows only), cross-attention ``attn2`` to the text (and CLIP image
  tokens for I2V) and feed-forward ``ffn``. Merging is inside each block's sub-modules, so the per-token
  modulation of Wan 2.2 TI2V and the hints of VACE act on whole tokens, as the blocks' outputs are unmerged.
  SkyReels-V2's block-causal mask (constant within a frame) follows the merged tokens; with ``st=1`` each frame
  merges within itself, so that is exact.
- HunyuanVideo 1.0 (T2V, I2V, token-replace): double- and single-stream blocks whose ``attn`` takes the image
  and the text as two streams and joins them [image, text]; the key mask ``(B, 1, 1, N + L)`` and the rotary
  table (video rows only) follow the merge.
- HunyuanVideo 1.5 (T2V, I2V): double-stream blocks only; ``attn`` takes the video and the context as two streams
  and joins them [video, context] inside; its mask ``(B, L)`` covers the context only (the processor pads it with
  the video's entries), so it passes whole; rotary ``(cos, sin)`` each ``(N, d)``, video rows only.
- CogVideoX 1.0 / 1.5: latent ``(B, F, C, H, W)`` (frames before channels); ``attn1`` joins [text, video], and
  the feed-forward runs on [text, video] too: only the video part is merged.
- LTX-Video: packed tokens, the grid from ``num_frames`` / ``height`` / ``width`` (or the video's last tokens in
  ``video_coords``, conditioning tokens before them); rotary ``(B, N, D)``.
- LTX-2: a video and an audio stream in every block; the video is merged, the audio passes whole.
- Mochi: ``attn1`` joins [video, valid text] per sample; its text mask passes whole; called with 1000 - t.

Recognised and refused: HunyuanVideo Framepack, Helios, AnyFlow (-FAR) and Wan-Animate 2 (each with its reason).
"""

from __future__ import annotations

from .spec import (
    CROSS,
    JOINT,
    MLP,
    SELF,
    TEXT_AFTER,
    TEXT_BEFORE,
    TEXT_NONE,
    Arg,
    ArgsGrid,
    Blocks,
    Family,
    LatentGrid,
    Mask,
    PerToken,
    Refused,
    Rotary,
    Target,
    Whole,
    block_has,
    has,
    has_list,
    takes,
)

__all__ = ["WAN", "HUNYUAN_VIDEO", "HUNYUAN_VIDEO_15", "COGVIDEOX", "LTX_VIDEO", "LTX2", "MOCHI", "REFUSED", "FAMILIES"]

_WAN_LAYOUT = has("patch_embedding", "rope", "condition_embedder") & has_list("blocks") & ~has("patch_short") \
    & ~has("far_patch_embedding") & block_has("blocks", "attn1", "attn2", "ffn")

WAN = Family(
    "wan",
    match=_WAN_LAYOUT & ~takes("r_timestep"),
    grid=LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size")),
    blocks=(Blocks("blocks", (Target("attn1", SELF, rotary=Rotary("rotary_emb", token_axis=1, text=TEXT_NONE),
                                     mask=Mask("attention_mask"), keys=TEXT_NONE),
                              Target("attn2", CROSS), Target("ffn", MLP)), requires=("attn1", "ffn"),
                    whole=Whole(rotary=Rotary("rotary_emb", token_axis=1, text=TEXT_NONE),
                                # (B, N, 6, D): Wan 2.2 TI2V; (B, 6, N, D): SkyReels-V2 diffusion forcing
                                per_token=(PerToken("temb"), PerToken("temb", axis=2, min_dim=4)))),),
    batch_pattern=True,
    description="Wan 2.1/2.2 (T2V, I2V, TI2V), VACE, Animate, SkyReels-V2, ChronoEdit",
    examples=("wan", "wan-i2v", "wan-ti2v", "wan-vace", "wan-animate", "skyreels-v2", "skyreels-v2-df", "chronoedit"),
)

_VIDEO_PATCH = ("patch_size_t", "patch_size", "patch_size")
# attention over the two streams, joined [video, text] inside; its key mask (B, 1, 1, N + L) follows the tokens
_HUNYUAN_ATTN = Target("attn", JOINT, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                       mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER)

def _hunyuan_whole(rotary: str) -> Whole:  # blocks return (video, text); token-replace counts frame-0 tokens
    return Whole(output=0, rotary=Rotary(rotary, text=TEXT_NONE, also=("image_rotary_emb",)),
                 mask=Mask("attention_mask", text=TEXT_AFTER),
                 refuse_if=("first_frame_num_tokens", "num_tokens"))


HUNYUAN_VIDEO = Family(
    "hunyuan-video",
    match=has("x_embedder", "context_embedder", "time_text_embed", "rope") & ~has("clean_x_embedder")
    & has_list("transformer_blocks", "single_transformer_blocks")
    & block_has("single_transformer_blocks", "attn", "proj_mlp", "act_mlp"),
    grid=LatentGrid(rank=3, patch=_VIDEO_PATCH),
    blocks=(Blocks("transformer_blocks", (_HUNYUAN_ATTN, Target("ff", MLP)), requires=("attn", "ff"),
                   whole=_hunyuan_whole("freqs_cis")),
            Blocks("single_transformer_blocks", (_HUNYUAN_ATTN,), requires=("attn", "proj_mlp"),
                   whole=_hunyuan_whole("image_rotary_emb"),
                   pointwise=(Target("proj_mlp", MLP, text=TEXT_AFTER), Target("proj_out", MLP, text=TEXT_AFTER)))),
    batch_pattern=True,
    description="HunyuanVideo 1.0 (T2V, I2V, token-replace I2V), Motif-Video",
    examples=("hunyuan-video", "hunyuan-video-i2v", "hunyuan-video-i2v-token-replace", "motif-video"),
)

COGVIDEOX = Family(
    "cogvideox",
    match=has("patch_embed", "time_embedding") & has_list("transformer_blocks")
    & block_has("transformer_blocks", "attn1", "ff", "norm1") & takes("image_rotary_emb", "timestep_cond"),
    grid=LatentGrid(rank=3, patch=_VIDEO_PATCH, axes=(1, 3, 4)),
    blocks=(Blocks("transformer_blocks", (
        Target("attn1", JOINT, rotary=Rotary("image_rotary_emb", text=TEXT_NONE), keys=TEXT_BEFORE),
        Target("ff", MLP, text=TEXT_BEFORE)), requires=("attn1", "ff"),
        whole=Whole(output=0, rotary=Rotary("image_rotary_emb", text=TEXT_NONE))),),
    batch_pattern=True,
    description="CogVideoX 1.0 / 1.5 (T2V, I2V), ConsisID-like layouts",
    examples=("cogvideox", "cogvideox-5b", "cogvideox-i2v", "cogvideox-1.5", "consisid"),
)

# LTXConditionPipeline gives ``video_coords`` instead of the integers and puts the tokens of conditioning frames
# before the video's: they pass whole ("before" the grid's tokens), with their rotary rows
_LTX_ROTARY = Rotary("image_rotary_emb", token_axis=-2, text=TEXT_BEFORE)
LTX_VIDEO = Family(
    "ltx-video",
    match=has("proj_in", "rope", "caption_projection") & has_list("transformer_blocks") & ~has("audio_proj_in")
    & block_has("transformer_blocks", "attn1", "attn2", "ff") & takes("num_frames", "height", "width"),
    grid=ArgsGrid(("num_frames", "height", "width"), coords=Arg("video_coords")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn1", SELF, text=TEXT_BEFORE, rotary=_LTX_ROTARY, keys=TEXT_BEFORE),
        Target("attn2", CROSS, text=TEXT_BEFORE), Target("ff", MLP, text=TEXT_BEFORE)),
        text=TEXT_BEFORE, requires=("attn1", "ff"), whole=Whole(rotary=_LTX_ROTARY, per_token=("temb",))),),
    batch_pattern=True,
    description="LTX-Video (T2V, I2V, condition: the conditioning frames' tokens pass whole)",
    examples=("ltx", "ltx-i2v"),
)

MOCHI = Family(
    "mochi",
    match=has("patch_embed", "time_embed", "rope") & has_list("transformer_blocks")
    & block_has("transformer_blocks", "attn1", "ff", "ff_context", "norm4"),
    grid=LatentGrid(rank=3, patch=(1, "patch_size", "patch_size")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn1", JOINT, rotary=Rotary("image_rotary_emb", token_axis=0, text=TEXT_NONE),
               mask=Mask("attention_mask", image=False), keys=TEXT_AFTER,
               reuse="its attention splits its output at its input's video token count (per sample, "
                     "[video | valid text])"),
        Target("ff", MLP)), requires=("attn1", "ff"),
        whole=Whole(output=0, rotary=Rotary("image_rotary_emb", token_axis=0, text=TEXT_NONE))),),
    timestep=Arg("timestep", reverse=True),
    batch_pattern=True,
    description="Mochi 1",
    examples=("mochi",),
)

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
    batch_pattern=True,
    description="HunyuanVideo 1.5 (T2V, I2V): double-stream blocks, the context's mask passes whole",
    examples=("hunyuan-video-1.5", "hunyuan-video-1.5-i2v"),
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
    batch_pattern=True,
    description="LTX-2 (audio + video): the video merged, the audio stream whole; appended keyframe tokens pass whole",
    examples=("ltx2",),
)

REFUSED = (
    Refused("hunyuan-video-framepack", has("clean_x_embedder", "x_embedder") & has_list("single_transformer_blocks"),
            "HunyuanVideo Framepack prepends history and clean-frame tokens (with their own rotary rows) to the "
            "video's in its image stream, and its attention key mask (B, 1, 1, S) spans [history | video | text]: "
            "tokens on both sides of the video's, which a mask cannot follow yet"),
    Refused("helios", has("patch_embedding", "patch_short", "patch_long") & has_list("blocks"),
            "Helios prepends short/mid/long history tokens, embedded at other patch sizes, to the video's in every "
            "block; that layout is not supported yet"),
    Refused("anyflow", _WAN_LAYOUT & takes("r_timestep"),
            "AnyFlow passes its rotary tables to attention as a dict (and a frames-first latent); that layout is "
            "not supported yet"),
    Refused("anyflow-far", has("far_patch_embedding", "patch_embedding") & has_list("blocks"),
            "AnyFlow-FAR generates in autoregressive chunks with a block mask and a key/value cache over earlier "
            "chunks; not supported yet"),
    Refused("wan-animate-2", has("patch_embedding") & has_list("blocks") & takes("condition_latents", "kv_cache")
            & block_has("blocks", "self_attn", "cross_attn", "ffn"),
            "Wan-Animate 2 takes per-sample lists of latents padded to seq_len, rotates its queries and keys inside "
            "self-attention by positions computed there from grid_sizes (not per-token rows that could follow the "
            "merge), and caches reference-frame keys and values across calls"),
)

FAMILIES = (WAN, HUNYUAN_VIDEO, HUNYUAN_VIDEO_15, COGVIDEOX, LTX_VIDEO, LTX2, MOCHI)
