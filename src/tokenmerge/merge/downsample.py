"""ToDo's token downsampling: the token grid pooled by a factor per side (keys/values of self-attention)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["downsample_tokens", "pooled_size", "slice_downsampler"]

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


def slice_downsampler(x: torch.Tensor, h: int, w: int, factor: int, mode: str = "nearest-exact") -> torch.Tensor:
    """ToDo's zero-overhead reference (the bench's "todo-limit"): the first ``h' * w'`` tokens, a free view.

    Not a downsampling (the keys/values it gives are meaningless): the attention on the pooled count is all that
    is left, the best speed any pooling to that count could reach.
    """
    ph, pw = pooled_size(h, w, factor)
    return x if factor == 1 else x[:, : ph * pw]
