"""ToDo on fused projections (``fuse_qkv_projections``): diffusers' fused processor sends keys and values given as
``encoder_hidden_states`` through ``attn.to_kv``, which a fused self-attention lacks; the patch gives it one that
takes the key and value rows of ``to_qkv`` (not a registered sub-module: nothing enters the state dict), and removes
it with the patch."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FusedKV", "give_to_kv", "take_to_kv"]


class FusedKV:
    """``attn.to_kv`` for a fused self-attention, which has only ``to_qkv``: the key and value rows of ``to_qkv``
    (computed by calling it, so LoRA or quantized layers keep working). A plain attribute, not a sub-module: the
    state dict and ``modules()`` are unchanged."""

    __slots__ = ("attn",)

    def __init__(self, attn: nn.Module):
        self.attn = attn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.attn.to_qkv(x)
        return qkv[..., qkv.shape[-1] // 3:]  # [q | k | v], three equal parts as the fused processor splits them


def give_to_kv(attentions) -> None:
    """``to_kv`` on each self-attention of ``attentions`` that can fuse its projections and has none, so that
    fusing them, before or after the patch, keeps ToDo working."""
    for attn in attentions:
        if callable(getattr(attn, "fuse_projections", None)) and not hasattr(attn, "to_kv"):
            attn.to_kv = FusedKV(attn)


def take_to_kv(attentions) -> None:
    """Undo ``give_to_kv``."""
    for attn in attentions:
        if isinstance(attn.__dict__.get("to_kv"), FusedKV):
            del attn.__dict__["to_kv"]
