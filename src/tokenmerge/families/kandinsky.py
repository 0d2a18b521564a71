"""The Kandinsky video line: Kandinsky 5, and Kandinsky 5 NABLA and Kandinsky 6 recognised and refused (layout facts:
docs/family-facts.md).

- Kandinsky 5 (regular attention): latent ``(B, F, H, W, C)`` channels last; ``visual_transformer_blocks`` with
  ``self_attention`` (rotary ``(B, N, 1, d/2, 2, 2)``), ``cross_attention`` to the text and ``feed_forward``.
  NABLA sparse attention reorders the tokens into 8x8 blocks and builds a block mask from them: refused.
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
                   config_is,
                   has,
                   has_list,
)

__all__ = ["KANDINSKY5", "FAMILIES", "REFUSED"]

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
    batch_pattern=True,
    description="Kandinsky 5 (T2V, I2V, T2I; regular attention)",
    examples=("kandinsky5",),
)

FAMILIES: tuple = (KANDINSKY5,)

REFUSED: tuple = (
    Refused("kandinsky5-nabla", _KANDINSKY5 & config_is("attention_type", "nabla"),
            "Kandinsky 5 with NABLA sparse attention reorders the video tokens into 8x8 blocks and builds a block "
            "mask from their queries and keys; merged tokens break both"),
    Refused("kandinsky6", has("visual_embeddings", "audio_embeddings") & has_list("visual_transformer_blocks")
            & block_has("visual_transformer_blocks", "video_dec_block", "va_cross_attention"),
            "Kandinsky 6 calls its video self-attention, cross-attention and feed-forward as sub-modules of a "
            "container (video_dec_block) inside each fused video/audio block, and tokenmerge targets only a block's "
            "own sub-modules; not supported yet"),
    Refused("kandinsky6-sr", has("visual_embeddings", "visual_rope_embeddings") & has_list("visual_transformer_blocks")
            & config_has("nabla_window"),
            "Kandinsky 6 SR orders its tokens in 8x8 tiles and runs NABLA sparse attention over 64-token blocks with "
            "a block mask made from their queries and keys; merged tokens break both"),
)
