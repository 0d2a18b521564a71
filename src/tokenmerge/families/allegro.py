"""Allegro: a video transformer that flattens the frames into its token sequence (layout facts:
docs/family-facts.md).

- Allegro: ``transformer_blocks`` of self-attention ``attn1``, cross-attention ``attn2`` and ``ff``; the 3-D
  rotary positions come as per-axis tables with per-token positions ``(1, N)``, which follow the merge.
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
                   Rotary,
                   Target,
                   block_has,
                   config_has,
                   has,
                   has_list,
                   takes,
)

__all__ = ["ALLEGRO", "FAMILIES"]

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
    batch_pattern=True,
    description="Allegro (3-D rotary from per-axis tables and per-token positions)",
    examples=("allegro",),
)

FAMILIES: tuple = (ALLEGRO,)
