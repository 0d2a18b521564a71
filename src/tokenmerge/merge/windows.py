"""Index tables of a token grid of any rank cut into windows, one destination token per window.

A grid ``shape = (n_0, ..., n_{d-1})`` holds its tokens in raster order (row-major: for a video grid
``(F, H, W)`` token ``(f, y, x)`` is ``(f * H + y) * W + x``). ``windows = (s_0, ..., s_{d-1})`` cuts it into
``n_i // s_i`` windows per axis, numbered in raster order over the window grid; a window's ``S = prod(s_i)``
tokens (its *choices*) are numbered row-major over the window's axes (2-D ``(sy, sx)``: ``k = dy * sx + dx``).
The tokens past the last whole window on some axis (a coordinate ``>= (n_i // s_i) * s_i``) belong to no
window: they are always sources.

Everything here is pure shape logic, cached per (shape, windows, ..., device), and written with static-shape
tensor ops only, because torch.compile traces it when it bypasses the caches (see ``_cached``).
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["num_windows", "window_grid", "window_split", "window_destinations", "random_offsets"]

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (lowbias32) on int64 tensors or Python ints: uniform, device-independent."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def random_offsets(num_windows: int, choices: int, key, device: torch.device) -> torch.Tensor:
    """One offset in ``[0, choices)`` per window, a pure function of ``key``.

    Args:
        key: a Python int or an int64 tensor of one element (on ``device``) identifying the draw
            (seed, block and timestep mixed together).
    """
    window = torch.arange(num_windows, device=device, dtype=torch.int64)
    return _mix32((window * 0x9E3779B1 + key) & _MASK32) % choices


def _cached(fn):
    """``fn`` under its cache, or the bare function while torch.compile traces (it bakes the tables in)."""
    return fn.__wrapped__ if torch.compiler.is_compiling() else fn


def check_grid(shape, windows, what: str = "windows") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``shape`` and ``windows`` as tuples of ints of the same rank (``windows`` entries at least 1)."""
    shape, windows = tuple(int(n) for n in shape), tuple(int(s) for s in windows)
    if len(shape) != len(windows) or not shape:
        raise ValueError(f"token grid {shape} and {what} {windows} must have the same rank (at least 1)")
    if min(windows) < 1 or min(shape) < 0:
        raise ValueError(f"token grid {shape} and {what} {windows}: sizes must be >= 0 and {what} >= 1")
    return shape, windows


def window_grid(shape, windows) -> tuple[int, ...]:
    """Whole windows per axis: ``n_i // s_i``."""
    return tuple(n // s for n, s in zip(shape, windows))


def num_windows(shape, windows) -> int:
    """The number of windows (and so of destinations): ``prod(shape[i] // windows[i])``."""
    return math.prod(window_grid(shape, windows))


def strides(shape) -> tuple[int, ...]:
    """Token index step of each axis (row-major)."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def coords(index: torch.Tensor, shape) -> list[torch.Tensor]:
    """The grid coordinates of flat token indices, one tensor per axis."""
    return [index // t % n for t, n in zip(strides(shape), shape)]


def _raster(sizes, steps) -> torch.Tensor:
    """``sum_i arange(sizes[i]) * steps[i]`` over the product of the ranges, flattened in row-major order."""
    out = torch.zeros((), dtype=torch.int64)
    for size, step in zip(sizes, steps):
        out = out.unsqueeze(-1) + torch.arange(size) * step
    return out.reshape(-1)


def _rest(shape, covered) -> torch.Tensor:
    """The tokens outside every window, in raster order: along axis 0, the rest of each covered slice's
    sub-grid, then every token of the slices past the covered ones (no data-dependent ops)."""
    rest = torch.arange(covered[-1], shape[-1])
    size = shape[-1]
    for n, c in zip(reversed(shape[:-1]), reversed(covered[:-1])):
        rest = torch.cat([(torch.arange(c).unsqueeze(1) * size + rest).reshape(-1), torch.arange(c * size, n * size)])
        size *= n
    return rest


@functools.lru_cache(maxsize=256)
def _grid(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    """``(origin, offset, other_offsets, rest)``: each window's first token ``(W,)``, the token offset of each
    choice ``(S,)``, of the other choices of each choice ``(S, S - 1)``, the tokens outside every window."""
    grid, step = window_grid(shape, windows), strides(shape)
    choices = math.prod(windows)
    origin = _raster(grid, [s * t for s, t in zip(windows, step)])
    offset = _raster(windows, step)
    j = torch.arange(choices - 1).unsqueeze(0)
    others = j + (j >= torch.arange(choices).unsqueeze(1)).long()  # (S, S-1): the choices but k, in order
    rest = _rest(shape, [g * s for g, s in zip(grid, windows)])
    to = functools.partial(torch.Tensor.to, device=device)
    return to(origin), to(offset), to(offset[others]), to(rest)


@functools.lru_cache(maxsize=256)
def _top_left(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    origin, offset, other_offsets, rest = _grid.__wrapped__(shape, windows, device)
    src = (origin.unsqueeze(1) + other_offsets[0]).reshape(-1)
    return origin + offset[0], torch.cat([src, rest])


def window_split(shape, windows, offsets: torch.Tensor | None, device):
    """Token indices ``(dst, src)`` of the grid for the given per-window choice (``None``: choice 0).

    ``dst`` ``(W,)``: each window's destination, in window order. ``src`` ``(N - W,)``: the other tokens of
    each window (window by window, in choice order), then the tokens outside every window in raster order.
    ``offsets`` may have leading dimensions ``(..., W)`` (one draw per folded grid): then so do both.
    """
    device = torch.device(device)
    shape, windows = tuple(shape), tuple(windows)
    if offsets is None:
        return _cached(_top_left)(shape, windows, device)
    origin, offset, other_offsets, rest = _cached(_grid)(shape, windows, device)
    dst = origin + offset[offsets]
    src = (origin.unsqueeze(-1) + other_offsets[offsets]).flatten(-2)
    return dst, torch.cat([src, rest.expand(*src.shape[:-1], -1)], -1)


def window_destinations(h: int, w: int, sx: int, sy: int, offsets: torch.Tensor | None, device):
    """``window_split`` of an ``h`` x ``w`` grid with ``sy`` x ``sx`` windows (the 2-D API)."""
    return window_split((h, w), (sy, sx), offsets, device)
