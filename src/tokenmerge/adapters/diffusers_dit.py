"""diffusers transformers over patch tokens: DiT, PixArt-alpha/Sigma, Stable Diffusion 3 (MMDiT) and Flux.

Matched by structure, never by class name, and nothing from diffusers is imported:
- DiT / PixArt (``DiTTransformer2DModel``, ``PixArtTransformer2DModel``, and the patched ``Transformer2DModel``
  of older diffusers): ``pos_embed`` patch embedding + ``transformer_blocks`` of basic blocks (attn1, attn2, ff);
- SD3 (``SD3Transformer2DModel``): ``pos_embed`` + ``transformer_blocks`` of joint blocks (``attn`` over image and
  text tokens, ``ff`` / ``ff_context``, and ``attn2`` image self-attention in SD3.5's dual-attention blocks);
- Flux (``FluxTransformerBlock`` / ``FluxSingleTransformerBlock``): ``x_embedder`` + ``transformer_blocks``
  (joint) + ``single_transformer_blocks`` (attention over the text and image tokens concatenated). Tokens carry
  rotary positions from ``img_ids``: the grid is read from them, and one merge pattern serves the whole batch
  so that every merged token keeps one position (that of the lowest-index token merged into it).

Tested on tiny configurations of each (tests/test_dit.py). Every block is at level 0: a transformer has one
resolution, so which blocks are patched is chosen by index (``blocks=``), default all.
"""

from __future__ import annotations

from torch import nn

from .base import ArgSpec, BlockSite, DenoiserSite, is_transformer_block

__all__ = ["find"]


def _config(module: nn.Module) -> dict:
    config = getattr(module, "config", None)  # diffusers' FrozenDict; a transformers config is not a dict
    return config if isinstance(config, dict) else {}


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _targets(block: nn.Module) -> tuple[tuple[str, str], ...] | None:
    if is_transformer_block(block):
        return (("attn1", "self"), ("attn2", "cross"), ("ff", "mlp"))
    attn = getattr(block, "attn", None)
    if not isinstance(attn, nn.Module):
        return None
    if isinstance(getattr(block, "ff", None), nn.Module):  # double-stream: SD3 joint, Flux double
        extra = (("attn2", "self"),) if isinstance(getattr(block, "attn2", None), nn.Module) else ()
        return (("attn", "joint"),) + extra + (("ff", "mlp"),)
    if isinstance(getattr(block, "proj_mlp", None), nn.Module):  # Flux single-stream
        return (("attn", "joint"),)
    return None


def _blocks(module: nn.Module, path: str, names: tuple[str, ...]) -> list[BlockSite] | None:
    sites = []
    for name in names:
        blocks = getattr(module, name, None)
        if not isinstance(blocks, nn.ModuleList):
            continue
        for i, block in enumerate(blocks):
            targets = _targets(block)
            if targets is None:
                return None  # a block we do not understand: not this family
            sites.append(BlockSite(_join(path, f"{name}.{i}"), block, 0, targets))
    return sites or None


def find(module: nn.Module, path: str) -> DenoiserSite | None:
    config = _config(module)
    timestep = ArgSpec.of(module, ("timestep", "timesteps"))
    if isinstance(getattr(module, "single_transformer_blocks", None), nn.ModuleList) and \
            isinstance(getattr(module, "x_embedder", None), nn.Module):
        ids = ArgSpec.of(module, ("img_ids",))
        blocks = _blocks(module, path, ("transformer_blocks", "single_transformer_blocks"))
        if ids is None or blocks is None:
            return None
        return DenoiserSite(path, module, "diffusers-flux", ids, timestep, blocks, patch=1, grid_from_ids=True,
                            timestep_scale=1000.0, shared_plan=True)
    patch = config.get("patch_size")
    if not isinstance(patch, int) or not isinstance(getattr(module, "pos_embed", None), nn.Module):
        return None
    sample = ArgSpec.of(module, ("hidden_states",), default_index=0)
    blocks = _blocks(module, path, ("transformer_blocks",))
    if sample is None or blocks is None:
        return None
    joint = any(kind == "joint" for b in blocks for _, kind in b.targets)
    return DenoiserSite(path, module, "diffusers-mmdit" if joint else "diffusers-dit", sample, timestep, blocks,
                        patch=patch)
