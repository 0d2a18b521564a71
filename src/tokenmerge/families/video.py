"""Video transformers over (frames, height, width) token grids.

- Wan 2.1 / 2.2 (T2V, I2V, TI2V) and its kin with the same block layout (VACE, Animate, SkyReels-V2, ChronoEdit):
  latent ``(B, C, F, H, W)``, ``patch_size=(1, 2, 2)``, ``blocks`` of self-attention ``attn1`` (rotary
  ``(cos, sin)`` each ``(1, N, 1, d)``, video rows only), cross-attention ``attn2`` to the text (and CLIP image
  tokens for I2V) and feed-forward ``ffn``. Merging is inside each block's sub-modules, so the per-token
  modulation of Wan 2.2 TI2V and the hints of VACE act on whole tokens, as the blocks' outputs are unmerged.
  SkyReels-V2's block-causal mask (constant within a frame) follows the merged tokens; with ``st=1`` each frame
  merges within itself, so that is exact.
"""

from __future__ import annotations

from .spec import (CROSS, MLP, SELF, TEXT_NONE, Blocks, Family, LatentGrid, Mask, Refused, Rotary, Target, block_has,
                   config_has, has, has_list)

__all__ = ["WAN", "REFUSED"]

ROTARY_SELF_REFUSES_TODO = (
    "ToDo cannot pool keys that carry rotary positions inside the attention call (Wan and kin), where every key "
    "gets the position of its token: pooled keys would need pooled positions, which that call cannot take. Use "
    "ToMe (apply_patch) on this model")

WAN = Family(
    "wan",
    match=has("patch_embedding", "rope", "condition_embedder") & has_list("blocks")
    & block_has("blocks", "attn1", "attn2", "ffn"),
    grid=LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size")),
    blocks=(Blocks("blocks", (Target("attn1", SELF, rotary=Rotary("rotary_emb", token_axis=1, text=TEXT_NONE),
                                     mask=Mask("attention_mask")),
                              Target("attn2", CROSS), Target("ffn", MLP)), requires=("attn1", "ffn")),),
    shared_plan=True,
    todo=ROTARY_SELF_REFUSES_TODO,
    description="Wan 2.1/2.2 (T2V, I2V, TI2V), VACE, Animate, SkyReels-V2, ChronoEdit",
)

REFUSED = (
    Refused("allegro", has("pos_embed") & has_list("transformer_blocks") & config_has("sample_frames")
            & config_has("patch_size_t"),
            "Allegro flattens its frames into one token sequence with 3-D rotary positions given as per-axis tables "
            "and per-token position grids; that layout is not supported yet"),
)
