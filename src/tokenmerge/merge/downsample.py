"""ToDo's token downsampling: the token grid pooled by a factor per axis (keys/values of self-attention).

Leading axes with factor 1 are folded into the batch first (a video pooled ``(1, 2, 2)`` is each frame pooled on
its own, bit for bit the 2-D pooling); what is left is pooled whole by ``F.interpolate`` (up to 3 axes), except
"avg" on 3 axes or more: each slice's last two axes by ``F.interpolate``, then the others by a product with the
area weights (separable; the strided 3-D area pooling is 6x slower).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["downsample", "pooled_shape", "downsample_tokens", "pooled_size"]

_MODES = {"nearest-exact": dict(mode="nearest-exact"), "avg": dict(mode="area"),
          "bilinear": dict(mode="bilinear", align_corners=False),
          "trilinear": dict(mode="trilinear", align_corners=False)}
_RANKS = {"bilinear": 2, "trilinear": 3}  # the grid rank these modes need (after folding, for bilinear)


def pooled_shape(shape, factors) -> tuple[int, ...]:
    """The pooled grid: ``ceil`` per axis so that sizes a factor does not divide keep their border tokens."""
    return tuple([-(-n // f) for n, f in zip(shape, factors)])


def _check(x: torch.Tensor, shape, factors, mode: str):
    if mode not in _MODES:
        raise ValueError(f"token downsampling: mode {mode!r} is not one of {sorted(_MODES)}")
    if x.shape[1] != math.prod(shape):
        raise RuntimeError(f"token downsampling: {x.shape[1]} tokens do not form the expected "
                           f"{' x '.join(map(str, shape))} grid")


def downsample(x: torch.Tensor, shape: tuple[int, ...], factors: tuple[int, ...],
               mode: str = "nearest-exact") -> torch.Tensor:
    """``(B, prod(shape), C) -> (B, prod(pooled_shape(shape, factors)), C)``, tokens in raster order.

    Modes: ``"nearest-exact"``, ``"avg"`` (area), ``"bilinear"`` (2-D grids, or 3-D with factor 1 on the first
    axis: each frame on its own), ``"trilinear"`` (3-D grids). Factor 1 on every axis returns ``x`` itself.
    """
    shape, factors = tuple(map(int, shape)), tuple(map(int, factors))
    if len(shape) != len(factors) or not shape or min(factors) < 1:
        raise ValueError(f"token downsampling: factors {factors} must be >= 1, one per axis of the grid {shape}")
    if max(factors) == 1:
        return x
    _check(x, shape, factors, mode)
    batch, _, channels = x.shape
    fold = 0  # leading axes with factor 1: slices pooled on their own (a batch), keeping at least two axes
    limit = len(shape) - _RANKS.get(mode, 2)
    while fold < limit and factors[fold] == 1:
        fold += 1
    outer, shape, factors = math.prod(shape[:fold]), shape[fold:], factors[fold:]
    if mode in _RANKS and len(shape) != _RANKS[mode]:
        hint = " (or factor 1 on the leading axes); use 'trilinear' for 3-D pooling" if mode == "bilinear" else ""
        raise ValueError(f"token downsampling: mode {mode!r} needs a {_RANKS[mode]}-D grid{hint}, "
                         f"got factors {factors} on a grid {shape} after folding")
    if mode == "avg" and len(shape) > 2:  # separable: each slice's last two axes, then the others by a product
        lead = list(shape[:-2])
        y = x if factors[-2:] == (1, 1) else _interpolate(
            x.reshape(-1, math.prod(shape[-2:]), channels), shape[-2:], factors[-2:], mode)
        y = y.reshape(batch * outer, *lead, -1)
        for axis, factor in enumerate(factors[:-2]):
            if factor > 1:
                size = math.ceil(lead[axis] / factor)
                flat = y.reshape(math.prod(y.shape[: axis + 1]), lead[axis], -1)
                lead[axis] = size
                y = (_area_weights(flat.shape[1], size, y.dtype, y.device) @ flat).reshape(batch * outer, *lead, -1)
        return y.reshape(batch, -1, channels)
    if len(shape) > 3:
        raise ValueError(f"token downsampling: at most 3 axes with factors above 1, got factors {factors}")
    return _interpolate(x.reshape(batch * outer, -1, channels), shape, factors, mode).reshape(batch, -1, channels)


def _area_weights(size: int, pooled: int, dtype, device) -> torch.Tensor:
    """``(pooled, size)``: the adaptive average pooling of an axis (``F.interpolate``'s "area") as a matrix."""
    i, j = torch.arange(pooled, device=device).unsqueeze(1), torch.arange(size, device=device)
    start, end = i * size // pooled, ((i + 1) * size + pooled - 1) // pooled
    return ((j >= start) & (j < end)).to(dtype) / (end - start).to(dtype)


def _interpolate(x: torch.Tensor, shape, factors, mode: str) -> torch.Tensor:
    """``F.interpolate`` of the ``(B, prod(shape), C)`` tokens' grid: ``(B, prod(pooled), C)`` (a view)."""
    batch, _, channels = x.shape
    grid = x.transpose(1, 2).reshape(batch, channels, *shape)
    pooled = F.interpolate(grid, size=pooled_shape(shape, factors), **_MODES[mode])
    return pooled.flatten(2).transpose(1, 2)


def pooled_size(h: int, w: int, factor: int) -> tuple[int, int]:
    """The pooled ``h`` x ``w`` grid (2-D API of ``pooled_shape``)."""
    return pooled_shape((h, w), (factor, factor))


def downsample_tokens(x: torch.Tensor, h: int, w: int, factor: int, mode: str = "nearest-exact") -> torch.Tensor:
    """``(B, h*w, C) -> (B, h'*w', C)`` with ``(h', w') = pooled_size(h, w, factor)``; factor 1 returns ``x``."""
    return downsample(x, (h, w), (factor, factor), mode)
