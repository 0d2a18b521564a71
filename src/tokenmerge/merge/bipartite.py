"""Bipartite soft matching with one destination token per window (ToMe for SD, Sec. 3-4), on grids of any rank.

The tokens of a grid (2-D ``(h, w)`` for images, 3-D ``(frames, h, w)`` for video) are split into destinations
(one per window, chosen at random or the window's first token) and sources (all the others, including the tokens
a window does not cover when the windows do not divide the grid; see ``windows.py``). Every source is matched
with its most similar destination (cosine similarity); the ``r`` best-matched sources over the whole grid are
averaged into their destinations.

Everything here is tensor code on the input's device: no host synchronisation, no global RNG.
"""

from __future__ import annotations

import math
import operator

import torch

from .local import _rank_slots, _slices, device_chunk, local_best_matches, local_soft_matching, local_soft_matching_2d
from .plan import IdentityPlan, MergePlan
from .windows import (_MASK32, _mix32, arange, check_grid, random_offsets, table, window_destinations, window_grid,
                      window_split)

__all__ = [
    "bipartite_soft_matching", "bipartite_soft_matching_2d", "local_soft_matching", "local_soft_matching_2d",
    "best_matches", "local_best_matches", "window_destinations", "random_offsets", "normalize_radius",
]
_ = (_MASK32, _mix32)  # re-exported: the hooks import them from here

# Similarity scores computed at once, at most (elements): above, sources are taken in chunks of rows, so the
# (B, Ns, Nd) matrix (3.2 GB per image at 2048 px for SD 1.5) is never held whole, and each chunk's maximum is
# taken while the chunk is still in cache. Every row is the same computation either way (same results).
SCORE_CHUNK = 2**22


def best_matches(src: torch.Tensor, dst: torch.Tensor, chunk: int | None = None):
    """For each source row, the highest similarity to any destination and which: ``(B, Ns)`` values, indices.

    ``src`` ``(B, Ns, C)`` and ``dst`` ``(B, Nd, C)`` are unit vectors; scores are their dot products.
    """
    chunk = device_chunk(SCORE_CHUNK, src.device) if chunk is None else chunk
    batch, num_src, num_dst = src.shape[0], src.shape[1], dst.shape[1]
    rows = max(1, chunk // max(1, batch * num_dst))
    dst_t = dst.transpose(1, 2)
    if rows >= num_src:
        return (src @ dst_t).max(dim=-1)
    parts = [(src[:, i: i + rows] @ dst_t).max(dim=-1) for i in range(0, num_src, rows)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def _radius_int(r, radius, shape):
    try:
        value = operator.index(r)
    except TypeError:
        value = -1
    if isinstance(r, bool) or value < 0:
        raise ValueError(f"radius {radius}: need None, an int >= 0, or one of them per axis of the grid {shape}")
    return value


def normalize_radius(radius, shape, windows) -> tuple:
    """``radius`` (``None``, an int, or a tuple of ints / ``None`` per axis) as a tuple per axis, with
    ``None`` on every axis the radius covers (at least ``n_i // s_i - 1`` windows: any window along it)."""
    rank = len(shape)
    radius = (radius,) * rank if radius is None or not isinstance(radius, (tuple, list)) else tuple(radius)
    if len(radius) != rank:
        raise ValueError(f"radius {radius}: need None, an int >= 0, or one of them per axis of the grid {shape}")
    radius = tuple(None if r is None else _radius_int(r, radius, shape) for r in radius)
    return tuple(None if r is None or r >= g - 1 else r for r, g in zip(radius, window_grid(shape, windows)))


def _folded_axes(shape, windows, radius) -> int:
    """How many leading axes are matched slice by slice (folded into the batch): those with window 1 and
    radius 0 (a video's frames merge within themselves: ``(0, None, None)``) or size 1, keeping two axes."""
    fold = 0
    while fold < len(shape) - 2 and windows[fold] == 1 and (radius[fold] == 0 or shape[fold] == 1):
        fold += 1
    return fold


def global_soft_matching(metric: torch.Tensor, shape, windows, r: int, offsets: torch.Tensor | None = None,
                         fold: int = 1) -> MergePlan:
    """ToMe's global matching: every source against every destination (of its slice when ``fold > 1``: the
    metric then holds ``fold`` grids ``shape`` one after the other, ranked together, slots numbered as in
    ``local_soft_matching``). Slots: the kept sources in rank order, then the destinations in window order."""
    batch, tokens, channels = metric.shape
    device = metric.device
    windows_each = math.prod(window_grid(shape, windows))
    if offsets is not None and fold > 1:
        offsets = offsets.view(fold, windows_each)
    dst, src = window_split(shape, windows, offsets, device)
    if fold > 1:  # token indices over the whole grid, slice by slice
        slices = _slices(fold, tokens // fold, device)
        dst, src = (dst + slices).reshape(-1), (src + slices).reshape(-1)
    num_src, num_dst = src.shape[0], dst.shape[0]
    r = min(r, num_src)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    src_metric, dst_metric = (metric.index_select(1, i).view(batch * fold, -1, channels) for i in (src, dst))
    best, best_dst = best_matches(src_metric, dst_metric)  # (B * fold, Ns / fold): each slice on its own
    if fold > 1:
        best = best.view(batch, -1)
        best_dst = (best_dst.view(batch, fold, -1) + _slices(fold, windows_each, device)).view(batch, -1)
    order = best.argsort(dim=-1, descending=True)  # (B, Ns): merged sources first
    kept = num_src - r
    # Slot layout of the merged sequence: [kept sources in `order` ... | destinations in grid order].
    merged, kept_slot = _rank_slots(num_src, r, device)
    slot_of_rank = torch.where(merged, best_dst.gather(1, order) + kept, kept_slot)  # (B, Ns): of the source ranked i
    dest = torch.empty(batch, tokens, dtype=torch.int64, device=device)
    dest.index_copy_(1, src, torch.empty_like(order).scatter_(1, order, slot_of_rank))
    dest.index_copy_(1, dst, (arange(kept + num_dst, device)[kept:]).expand(batch, num_dst))
    return MergePlan(dest, kept + num_dst)


def bipartite_soft_matching(metric: torch.Tensor, shape: tuple[int, ...], windows: tuple[int, ...], r: int,
                            offsets: torch.Tensor | None = None, radius=None):
    """Build the merge plan of ToMe for SD on a token grid of any rank.

    Args:
        metric: ``(B, N, C)`` features the similarity is measured on, ``N == prod(shape)``, tokens in raster
            order (video ``(F, H, W)``: token ``(f, y, x)`` at ``(f * H + y) * W + x``).
        shape: the token grid.
        windows: window size per axis (2-D ``(sy, sx)``; video ``(1, 2, 2)`` or ``(2, 2, 2)``).
        r: number of tokens to remove (capped at the number of sources), ranked over the whole grid.
        offsets: ``(num_windows(shape, windows),)`` int64 choice of destination in each window (windows in
            raster order, choices numbered row-major over the window's axes), or ``None`` for choice 0.
        radius: ``None`` (ToMe's global matching): every source is compared with every destination.
            An int ``R``: only with the destinations of the windows at most ``R`` windows away along every
            axis (0 = its own window's); cost linear in the token count. A tuple: one int or ``None``
            (unlimited) per axis, e.g. ``(0, None, None)`` on ``(F, H, W)`` with windows ``(1, 2, 2)``: each
            frame merges within itself (matched frame by frame, ranked over the whole grid); ``(0, R, R)``: in
            its frame, at most ``R`` windows away. A radius that covers an axis is ``None`` on it.

    Returns:
        a ``MergePlan`` (or the exact ``IdentityPlan`` when ``r <= 0`` or the grid has no whole window).
    """
    shape, windows = check_grid(shape, windows)
    batch, tokens, _ = metric.shape
    if tokens != math.prod(shape):
        raise RuntimeError(f"token merging: {tokens} tokens do not form the expected "
                           f"{' x '.join(map(str, shape))} grid")
    uniform = radius is not None and not isinstance(radius, (tuple, list))  # one int for every axis
    given, radius = radius, normalize_radius(radius, shape, windows)
    if r <= 0 or math.prod(window_grid(shape, windows)) == 0:
        return IdentityPlan(tokens)
    with torch.no_grad():
        axes = _folded_axes(shape, windows, radius)
        fold, shape, windows, radius = math.prod(shape[:axes]), shape[axes:], windows[axes:], radius[axes:]
        if all(rad is None for rad in radius):
            return global_soft_matching(metric, shape, windows, r, offsets, fold=fold)
        if uniform and len(shape) == 2:  # one radius on a 2-D grid: as given, even on an axis it covers (the
            radius = (operator.index(given),) * 2  # tiling, and so the plan, of the 2-D API)
        return local_soft_matching(metric, shape, windows, r, offsets, radius, fold=fold)


def bipartite_soft_matching_2d(
    metric: torch.Tensor,
    h: int,
    w: int,
    sx: int,
    sy: int,
    r: int,
    offsets: torch.Tensor | None = None,
    radius: int | None = None,
):
    """``bipartite_soft_matching`` of an ``h`` x ``w`` grid with ``sy`` x ``sx`` windows (the 2-D API).

    Args:
        metric: ``(B, N, C)`` features the similarity is measured on, ``N == h * w``.
        h, w: the token grid.
        sx, sy: window size.
        r: number of tokens to remove (capped at the number of sources).
        offsets: ``(num_windows,)`` int64 choice of destination in each window (``k = dy * sx + dx``),
            or ``None`` for top-left.
        radius: ``None`` (ToMe's global matching): every source is compared with every destination.
            An integer: only with the destinations of the windows at most ``radius`` windows away
            (``(2 * radius + 1) ** 2`` candidates; 0 = its own window's). An approximation whose cost grows
            with the token count instead of its square; a radius that covers the grid is the global matching.

    Returns:
        a ``MergePlan`` (or the exact ``IdentityPlan`` when ``r <= 0``).
    """
    return bipartite_soft_matching(metric, (h, w), (sy, sx), r, offsets, radius)
