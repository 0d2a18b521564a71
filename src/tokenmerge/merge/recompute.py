"""Token reuse's tensor code (``tokenmerge.apply_reuse``): which tokens a partial step recomputes, how the others'
kept residuals take their recomputed neighbours' change, and where fresh rows go among kept ones. No model here.

- ``fraction_at``: the share of image tokens a step recomputes (``None``: a full step), from the step's place in the
  generation; ``recomputed_at``: the tokens a partial step recomputes, where the round-robin has got to.
- ``select``: the ``count`` tokens of an order (``"grid"``, ``"strided"``, ``"random"``) from position ``start`` on,
  sorted: round-robin, every token once every ``ceil(N / count)`` partial steps.
- ``spread_weights`` / ``spread``: each token not recomputed gets ``alpha`` x the mean change of the recomputed
  tokens in its 3x3 (video: 3x3x3) neighbourhood (ClusCa's idea).
- ``since`` / ``settle`` / ``in_dtype`` / ``slope_of`` / ``write_rows`` / ``write_kept`` / ``extrapolated`` /
  ``row_spans``: ``extrapolate=``: each kept residual (and kept key and value) moves along its token's last measured
  change per unit of denoising progress (a first-order Taylor step per token, TaylorSeer's idea, with the recomputed
  tokens' changes measured as they come round).
- ``kept_rows``: the rows of a kept key sequence that a partial step's fresh keys overwrite (text, image and
  reference rows; one segment per rank under Ulysses context parallelism).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .plan import TABLES, Tables, arange, sided_rows

__all__ = ["fraction_at", "select", "recomputed_at", "spread_weights", "spread", "since", "settle", "in_dtype",
           "slope_of", "extrapolated", "write_rows", "write_kept", "row_spans", "kept_rows"]


def fraction_at(step: int, progress: float, first: float | None, fraction: float, fraction_end: float | None,
          warmup: int, every: int) -> float | None:
    """The share of image tokens that step ``step`` of a generation (0: its first) recomputes, ``None`` for a full
    step: the first ``warmup`` steps and every ``every``-th after them are full; a partial step at denoising
    ``progress`` (0: noise, 1: the end) recomputes ``fraction``, moving linearly to ``fraction_end`` at the end from
    the generation's first partial step (at ``first``; ``None``: this one), a full step where that share is 1."""
    if step < warmup or (every and (step - warmup + 1) % every == 0):
        return None
    part = fraction
    first = progress if first is None else first
    if fraction_end is not None and first < 1.0:
        part += (fraction_end - fraction) * min(1.0, max(0.0, (progress - first) / (1.0 - first)))
    return None if part >= 1.0 else part


def select(grid: tuple[int, ...], order: str, count: int, seed: int, start: int, device,
           tables: Tables = TABLES) -> torch.Tensor:
    """``(count,)`` sorted indices of image tokens to recompute: the ``count`` tokens of the order from position
    ``start`` on (round-robin: each partial step starts where the last one ended, so every token is recomputed
    once every ``ceil(N / count)`` partial steps).

    Example:
        >>> select((4, 4), "strided", 4, 0, 0, "cpu").tolist()
        [0, 4, 8, 12]
    """
    return tables.get(window, grid, order, count, seed, start % math.prod(grid), torch.device(device))


def recomputed_at(grid: tuple[int, ...], fractions: list[float], order: str, seed: int, device,
                  tables: Tables = TABLES) -> torch.Tensor:
    """The tokens of ``grid`` that the last of partial steps of ``fractions`` recomputes (``select``): as many as
    its share of them (at least one, at most all), from where the round-robin has
    got to (the sum of those its predecessors recomputed).

    Example:
        >>> recomputed_at((8,), [0.5, 0.25], "strided", 0, "cpu").tolist()  # 2 tokens, from the order's 5th on
        [2, 6]
    """
    tokens, start, count = math.prod(grid), 0, 0
    for f in fractions:
        start += count
        count = min(tokens, max(1, round(f * tokens)))
    return tables.get(window, grid, order, count, seed, start % tokens, torch.device(device))


def window(tables: Tables, grid: tuple[int, ...], order: str, count: int, seed: int, start: int,
           device) -> torch.Tensor:
    """What ``select`` keeps in its table store: the window of the order (itself a table, on the host) from
    ``start``, sorted, on ``device``."""
    n = math.prod(grid)
    picked = tables.get(_order, grid, order, count, seed)[(torch.arange(count) + start) % n]
    return picked.sort().values.to(device)


window.takes_tables = True


def _order(grid: tuple[int, ...], order: str, count: int, seed: int) -> torch.Tensor:
    """A permutation of the ``N`` image tokens (raster order over ``grid``) whose consecutive windows of ``count``
    are each spread over the image (a table of the host, made once per grid and count)."""
    n = math.prod(grid)
    i = torch.arange(n)
    if order == "random":
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if order == "strided":  # every c-th token in raster order, c = N / count: the residues one after another
        c = max(1, round(n / count))
        return torch.argsort((i % c) * n + i)
    # grid: each token's rank inside its 2x2 window (a Bayer pattern; on a video grid, frames in pairs too), then the
    # window's index, so that a window of the order holds the same ranks of every window of the grid
    coords = torch.stack(torch.meshgrid(*[torch.arange(g) for g in grid], indexing="ij"), -1).reshape(n, -1)
    rank = torch.tensor([[0, 2], [3, 1]])[coords[:, -2] % 2, coords[:, -1] % 2]
    halved = {len(grid) - 1, len(grid) - 2}
    if len(grid) > 2:
        rank = rank * 2 + coords[:, -3] % 2
        halved.add(len(grid) - 3)
    windows = torch.zeros(n, dtype=torch.long)
    for axis, size in enumerate(grid):
        s = 2 if axis in halved else 1
        windows = windows * -(-size // s) + coords[:, axis] // s
    return torch.argsort(rank * n + windows)


def spread_weights(chosen: torch.Tensor, grid: tuple, alpha: float, dtype: torch.dtype, device) -> torch.Tensor:
    """``(1, N, 1)``: ``alpha`` over the share of recomputed tokens (``chosen``) in each token's 3x3 (video: 3x3x3)
    neighbourhood of ``grid``, 0 where it has none and on the recomputed tokens themselves (the same for every block
    of a call: a table)."""
    mask = torch.zeros(1, math.prod(grid), 1, dtype=dtype, device=device)
    mask.index_fill_(1, chosen, 1.0)
    count = _box(mask, grid)  # a mean over the window, as the change's: their ratio is the recomputed tokens' mean
    return torch.where(count > 0, alpha / count.clamp_min(1e-6), 0.0) * (1 - mask)


def spread(kept: torch.Tensor, change: torch.Tensor, chosen: torch.Tensor, grid: tuple,
           weight: torch.Tensor) -> None:
    """Add to ``kept`` ``(B, N, C)``, on each token not recomputed, ``alpha`` times the mean ``change`` ``(B, |S|,
    C)`` of the recomputed tokens ``chosen`` in its neighbourhood (``weight`` from ``spread_weights``)."""
    b, _, c = change.shape
    full = change.new_zeros(b, kept.shape[1], c)
    full.index_copy_(1, chosen, change)
    kept.addcmul_(_box(full, grid), weight)


def _box(x: torch.Tensor, grid: tuple) -> torch.Tensor:
    """``x`` ``(B, N, C)`` over ``grid``: the mean over each token's 3 x ... x 3 neighbourhood, the grid's edges
    padded with 0 (a pooling over the last two axes, channels last; the leading ones by shifted sums)."""
    b, n, c = x.shape
    h, w = (1, *grid)[-2:]
    y = F.avg_pool2d(x.reshape(-1, h, w, c).permute(0, 3, 1, 2), 3, stride=1, padding=1).permute(0, 2, 3, 1)
    y = y.reshape(b, *grid[:-2], h * w, c)
    for axis in range(1, len(grid) - 1):
        size = y.shape[axis]
        out = y.clone()
        out.narrow(axis, 1, size - 1).add_(y.narrow(axis, 0, size - 1))
        out.narrow(axis, 0, size - 1).add_(y.narrow(axis, 1, size - 1))
        y = out / 3
    return y.reshape(b, n, c)


def since(when: dict, key, tokens: int, index: torch.Tensor | None, progress: float, factor: float,
          moves: list) -> tuple | None:
    """The denoising progress since tokens were last computed, for one level of one slot; ``when[key]`` ``(N,)``
    holds each token's progress at its last computation, moved to this call's by ``settle`` once the call has run
    (``moves`` collects it: a step a cache skipped computed nothing). Returns ``None`` when nothing was computed
    before (no change known), ``(span, None)`` at a full step (``index`` ``None``: every token's span), ``(span of the
    recomputed tokens (|S|,), factor x every token's span (N,), 0 at the recomputed, factor x the recomputed tokens'
    span)`` at a partial one."""
    last = when.get(key)
    moves.append((key, tokens, index, progress))
    if last is None or last.shape[0] != tokens:
        return None
    span = (progress - last).clamp_min(1e-6)
    if index is None:
        return span, None
    ahead = span.index_fill(0, index, 0.0).mul_(factor)
    at = span.index_select(0, index)
    return at, ahead, at * factor


def settle(when: dict, moves: list, device) -> None:
    """Move ``when`` to the progress of the tokens a call computed (``since``'s ``moves``, emptied)."""
    while moves:
        key, tokens, index, progress = moves.pop()
        last = when.get(key)
        if last is None or last.shape[0] != tokens:
            when[key] = torch.full((tokens,), progress, dtype=torch.float32, device=device)
        elif index is None:
            last.fill_(progress)
        else:
            last.index_fill_(0, index, progress)


def in_dtype(store: dict, key, dtype: torch.dtype) -> tuple | None:
    """``store[key]`` (``since``'s spans, or ``None``) in ``dtype``: converted once per call and dtype, kept in
    ``store`` under ``(key, dtype)`` for every block of the call (afresh under torch.compile, which fuses it)."""
    spans = store.get(key)
    if spans is None:
        return None
    found = None if torch.compiler.is_compiling() else store.get((key, dtype))
    if found is None:
        found = tuple(None if g is None else g.to(dtype) for g in spans)
        if not torch.compiler.is_compiling():
            store[key, dtype] = found
    return found


def slope_of(new: torch.Tensor, old: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """``(new - old) / span``: the change per unit of progress of rows ``(..., n, C)`` (residuals, keys, values) over
    their spans ``(n,)``."""
    return (new - old).div_(span.to(new.dtype)[:, None])


def extrapolated(kept: torch.Tensor, slope: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
    """Every row's ``kept + slope x ahead`` (rows ``(..., n, C)``; ``ahead`` ``(n,)`` from ``since``: 0 at the
    recomputed ones)."""
    return torch.addcmul(kept, slope, ahead.to(kept.dtype)[:, None])


def write_kept(kept: dict, key, slopes: dict, slope_key, fresh: torch.Tensor, index: torch.Tensor | None,
           spans) -> torch.Tensor | None:
    """Write ``fresh`` ``(B, n, C)`` into the kept ``kept[key]`` at ``index`` (``None``: all of it), and with ``spans``
    (``extrapolate=``) the fresh rows' change per unit of progress into ``slopes[slope_key]``; returns the slopes
    every row moves along at a partial step (``None``: none)."""
    was = kept.get(key)
    if index is None:
        if spans is not None and was is not None and was.shape == fresh.shape:
            slopes[slope_key] = slope_of(fresh, was, spans[0])
        else:
            slopes.pop(slope_key, None)
        kept[key] = fresh
        return None
    if spans is None:
        was.index_copy_(1, index, fresh)
        return None
    slope = slopes.get(slope_key)
    if slope is None:  # no change measured yet: held until a token's first is
        slope = slopes[slope_key] = torch.zeros_like(was)
    write_rows(was, slope, fresh, index, spans[0])
    return slope


def write_rows(kept: torch.Tensor, slope: torch.Tensor, fresh: torch.Tensor, index: torch.Tensor,
               span: torch.Tensor) -> None:
    """Write ``fresh`` rows ``(..., |S|, C)`` into ``kept`` ``(..., n, C)`` at ``index`` (the rows' axis, -2), and
    their change per unit of progress since the rows kept there (``span`` ``(|S|,)``) into ``slope``."""
    slope.index_copy_(-2, index, slope_of(fresh, kept.index_select(-2, index), span))
    kept.index_copy_(-2, index, fresh)


def row_spans(image: tuple, text: tuple | None, fresh_before: int, before: int, after: int, segments: int) -> tuple:
    """The spans of a key sequence's rows from ``since``'s of its image (and text) tokens: ``(at, ahead)``, ``at`` for
    a partial step's fresh ``[text | recomputed | after]`` rows (text rows without spans, recomputed at every step,
    take 1: their slopes are never used), ``ahead`` for the kept ``[before | image | after]`` rows (0 where fresh;
    ``None`` at a full step, whose every row is fresh); repeated over ``segments`` (one sequence per rank under
    Ulysses attention, every rank's spans alike)."""
    at, ahead = image[:2]
    text_at, text_ahead = text[:2] if text is not None else (None, None)
    one = at.new_ones(1)
    parts = [text_at if text_at is not None else one.expand(fresh_before), at, one.expand(after)]
    at = torch.cat(parts).repeat(segments)
    if ahead is not None:
        zero = ahead.new_zeros(1)
        parts = [text_ahead if text_ahead is not None else zero.expand(before), ahead, zero.expand(after)]
        ahead = torch.cat(parts).repeat(segments)
    return at, ahead


def kept_rows(index: torch.Tensor, text: torch.Tensor | None, before: int, image: int, after: int, fresh_before: int,
              segments: int, tables: Tables = TABLES) -> torch.Tensor:
    """Where each row of a partial step's key sequence goes in the kept one: fresh ``[text | index | after]`` rows
    (``fresh_before`` text rows: every text row, or the recomputed ones ``text``), kept ``[before | image | after]``
    rows; ``segments`` such sequences one after another (one per rank under Ulysses attention)."""
    rows = sided_rows(index, before, image, after, tables, text)
    if text is None and fresh_before != before:
        raise ValueError(f"tokenmerge: {fresh_before} text rows where {before} were kept")
    if segments == 1:
        return rows
    total = before + image + after
    return (tables.get(arange, segments, rows.device)[:, None] * total + rows).flatten()
