"""ToMe's bipartite soft matching as plain functions (tomesd's API, on grids of any rank): each builds the grid's
``Matching`` (``match.py``) and runs it once. The engine keeps a grid's matching across calls instead."""

from __future__ import annotations

import torch

from .match import LocalMatching, matching
from .plan import MergePlan
from .windows import check_grid

__all__ = ["bipartite_soft_matching", "bipartite_soft_matching_2d", "local_soft_matching", "local_soft_matching_2d"]


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

    Example:
        >>> plan = bipartite_soft_matching(torch.randn(1, 16, 8), (4, 4), (2, 2), r=8)
        >>> plan.merge(torch.randn(1, 16, 8)).shape
        torch.Size([1, 8, 8])
    """
    return matching(shape, windows, radius, metric.device)(metric, r, offsets)


def bipartite_soft_matching_2d(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, r: int,
                               offsets: torch.Tensor | None = None, radius: int | None = None):
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


def local_soft_matching(metric: torch.Tensor, shape, windows, r: int, offsets: torch.Tensor | None, radius,
                        chunk: int | None = None, tile=None, fold: int = 1, dense: bool | None = None) -> MergePlan:
    """ToMe's plan with every source matched only against the destinations of the windows within ``radius``
    (a tuple: an int or ``None`` per axis) on a grid ``shape`` with ``windows``.

    ``fold``: the metric holds ``fold`` such grids one after the other (``(B, fold * N, C)``: the leading axes
    of a larger grid, each slice matched on its own). ``dense``, ``tile``, ``chunk``: the way, tile size and chunk
    size (``None``: those of the metric's device). An axis whose radius is ``None`` is taken whole by each tile.
    """
    shape, windows = check_grid(shape, windows)
    m = LocalMatching(shape, windows, tuple(radius), fold, metric.device, dense=dense, tile=tile, chunk=chunk)
    return m(metric, r, offsets)


def local_soft_matching_2d(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, r: int,
                           offsets: torch.Tensor | None, radius: int, chunk: int | None = None,
                           tile: int | None = None) -> MergePlan:
    """``local_soft_matching`` of an ``h`` x ``w`` grid with ``sy`` x ``sx`` windows and one ``radius``
    (``bipartite_soft_matching_2d(..., radius=radius)``)."""
    return local_soft_matching(metric, (h, w), (sy, sx), r, offsets, (radius, radius), chunk=chunk, tile=tile)
