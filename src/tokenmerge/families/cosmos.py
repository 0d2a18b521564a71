"""NVIDIA's Cosmos world models: Cosmos 1.0, Cosmos-Predict 2 / 2.5 and Cosmos-Transfer 2.5 (layout facts:
docs/family-facts.md).

- Cosmos 1.0 and Cosmos-Predict 2 / 2.5: ``attn1`` self-attention with rotary ``(cos, sin)`` each ``(N, d)``,
  ``attn2`` cross-attention, ``ff``; AdaLN-LoRA modulation (per token with per-frame timesteps) outside the merged
  sub-modules. Cosmos 1.0 (its learnable extra position embedding) is called with EDM's ``c_noise = log(sigma) / 4``,
  Predict 2 / 2.5 with ``sigma / (1 + sigma)`` in 0..1.
"""

from __future__ import annotations

from .spec import (
                   CROSS,
                   MLP,
                   SELF,
                   TEXT_NONE,
                   Arg,
                   Blocks,
                   Family,
                   LatentGrid,
                   Rotary,
                   Target,
                   block_has,
                   config_has,
                   has,
                   has_list,
)

__all__ = ["COSMOS", "COSMOS_PREDICT2", "FAMILIES"]

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
    batch_pattern=True,
    description="Cosmos 1.0 (text- and video-to-world; EDM log-sigma timesteps)",
    examples=("cosmos", "cosmos-v2w"),
)

COSMOS_PREDICT2 = Family(  # no learnable extra position embedding; timesteps sigma / (1 + sigma) in 0..1
    "cosmos-predict2",
    match=_COSMOS & ~has("learnable_pos_embed"),
    grid=_COSMOS_GRID,
    blocks=_COSMOS_BLOCKS,
    timestep=Arg("timestep", scale=1000.0),
    batch_pattern=True,
    description="Cosmos-Predict 2 / 2.5 and Cosmos-Transfer 2.5 (0..1 timesteps)",
    examples=("cosmos-predict2",),
)

FAMILIES: tuple = (COSMOS, COSMOS_PREDICT2)
