"""ToDo's token downsampling: the token grid pooled by a factor per side (keys/values of self-attention)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["downsample_tokens", "pooled_size"]

_MODES = {"nearest-exact": dict(mode="nearest-exact"), "avg": dict(mode="area"),
          "bilinear": dict(mode="bilinear", align_corners=False)}


def pooled_size(h: int, w: int, factor: int) -> tuple[int, int]:
    """The pooled grid: ``ceil`` so that sizes the factor does not divide keep their border tokens."""
    return math.ceil(h / factor), math.ceil(w / factor)


def downsample_tokens(x: torch.Tensor, h: int, w: int, factor: int, mode: str = "nearest-exact") -> torch.Tensor:
    """``(B, h*w, C) -> (B, h'*w', C)`` with ``(h', w') = pooled_size(h, w, factor)``; factor 1 returns ``x``."""
    if factor == 1:
        return x
    batch, tokens, channels = x.shape
    if tokens != h * w:
        raise RuntimeError(f"token downsampling: {tokens} tokens do not form the expected {h} x {w} grid")
    grid = x.transpose(1, 2).reshape(batch, channels, h, w)
    pooled = F.interpolate(grid, size=pooled_size(h, w, factor), **_MODES[mode])
    return pooled.flatten(2).transpose(1, 2)
