"""The SANA line's video models: SANA-Video, and SANA-WM recognised and refused (layout facts:
docs/family-facts.md).

- SANA-Video: linear self-attention ``attn1`` with Wan-style rotary ``(1, N, 1, d)``, cross-attention ``attn2``;
  the feed-forward ``GLUMBTempConv`` convolves over the (F, H, W) grid and cannot take merged tokens.
"""

from __future__ import annotations

from .spec import (
                   CROSS,
                   MLP,
                   SELF,
                   TEXT_NONE,
                   Blocks,
                   Family,
                   LatentGrid,
                   Refused,
                   Rotary,
                   Target,
                   block_has,
                   config_has,
                   has,
                   has_list,
                   takes,
)

__all__ = ["LINEAR_ROTARY_TODO", "SANA_VIDEO", "FAMILIES", "REFUSED"]

LINEAR_ROTARY_TODO = (
    "ToDo cannot pool the keys of this linear attention: rotary positions are applied to every key inside the "
    "attention call (pooled keys would need pooled positions), and the call makes no softmax attention call in which "
    "they could be pooled after that. Use ToMe (apply_patch) on this model")

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
    batch_pattern=True,
    todo_refused=LINEAR_ROTARY_TODO,
    description="SANA-Video (linear attention with 3-D rotary; the feed-forward is not merged)",
    examples=("sana-video",),
)

FAMILIES: tuple = (SANA_VIDEO,)

REFUSED: tuple = (
    Refused("sana-wm", has("x_embedder", "plucker_embedder", "rope") & has_list("blocks") & takes("camera_conditions"),
            "SANA-WM's self-attention (gated-delta linear attention with temporal short convolutions and per-token "
            "camera ray transforms) and its GLUMBConvTemp feed-forward work on the (frames, height, width) grid of "
            "the tokens"),
    Refused("sana-wm-refiner", has("proj_in", "rope") & has_list("transformer_blocks")
            & takes("video_rotary_emb", "kv_cache") & ~takes("num_frames"),
            "The SANA-WM refiner takes packed tokens without their grid (only their rotary tables) and attends over "
            "a key/value cache of earlier chunks with attention sinks"),
)
