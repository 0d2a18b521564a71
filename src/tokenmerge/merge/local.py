"""Local matching: ToMe's plan with every source matched only against the destinations of nearby windows.

``O(N)`` work on a grid of any rank. Each axis has a radius: an int ``R`` (only windows at most ``R`` windows
away along it) or ``None`` (any window along it: the axis is taken whole). The windows are cut into tiles of
``T_i`` windows per axis (``T_i = g_i``, the whole axis, where the radius is ``None``) and each tile's tokens
are scored against its neighbourhood's destinations (``T_i + 2 R_i`` windows per axis) in one small product.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math

import torch

from .plan import MergePlan
from .windows import _grid, _raster, arange, coords, strides, table, window_dst, window_grid

__all__ = ["local_soft_matching", "local_soft_matching_2d", "local_best_matches"]

# Local matching cuts the windows into tiles of LOCAL_TILE windows per axis (2-D; at least 2 * radius) and scores
# each tile's tokens against its neighbourhood's destinations in one small product. LOCAL_CHUNK: the elements
# (gathered tokens and scores) handled at once, at most, so that a chunk's copies stay small and in cache and no
# temporary is near the size at which allocators map fresh pages (32 MB for glibc).
LOCAL_TILE = 4
LOCAL_CHUNK = 2**20
# Off the CPU (CUDA, MPS) a chunk is kernels to launch, each costing the host about as much as a small kernel runs:
# the products are taken whole, up to GPU_CHUNK elements (512 MB of fp16 scores) at once.
GPU_CHUNK = 2**28
# Off the CPU, a grid whose (tokens x windows) scores fit DENSE_LIMIT elements per grid is matched by one product of
# every token with every destination, the windows out of reach masked (a cached table): a handful of kernels, where
# the tiles take a dozen more (on a CPU the tiles' O(N) work is the faster: there they are always used).
DENSE_LIMIT = 2**22


_PATHS: str | None = None  # the device type whose code paths run, whatever the tensors' (``code_paths``)


@contextlib.contextmanager
def code_paths(device_type: str):
    """Run the code paths of ``device_type`` ("cuda", "cpu") whatever device the tensors are on: the kernels a
    CUDA call launches can then be counted on a CPU (``tokenmerge.bench.kernels``)."""
    global _PATHS
    before, _PATHS = _PATHS, device_type
    try:
        yield
    finally:
        _PATHS = before


def _on_cpu(device: torch.device) -> bool:
    return (_PATHS or device.type) == "cpu"


def device_chunk(chunk: int, device: torch.device) -> int:
    """The elements handled at once on ``device``: ``chunk`` (sized for CPU caches) on the CPU, ``GPU_CHUNK``
    elsewhere."""
    return chunk if _on_cpu(device) else max(chunk, GPU_CHUNK)


def tile_sizes(grid, radii, tile=None) -> tuple[int, ...]:
    """Windows per tile along each axis: the whole axis where the radius is ``None``; elsewhere ``max(tile_i,
    2 * R_i, 1)`` for a ``tile`` given (an int for every axis or one per axis), and by default: 1 when the
    whole axes hold 16 windows or more (the tile is large already: a thin one scores the fewest far
    candidates); else ``R_i + 1`` on grids of rank 3 and more (a tile of 4^3 windows would score (4 + 2R)^3
    candidates: 2^3 is about 2x faster at R = 1 on a video grid, 1 at R = 0); else ``max(LOCAL_TILE, 2 R_i)``.
    """
    if tile is None:
        whole = math.prod([g for g, rad in zip(grid, radii) if rad is None])  # lists: torch.compile traces this
        if whole >= 16 or len(grid) > 2:
            return tuple(g if rad is None else 1 if whole >= 16 else rad + 1 for g, rad in zip(grid, radii))
        tile = LOCAL_TILE
    tile = (tile,) * len(grid) if isinstance(tile, int) else tuple(tile)
    return tuple(g if rad is None else max(t, 2 * rad, 1) for g, rad, t in zip(grid, radii, tile))


def _slabs(shape, windows, radii) -> list[tuple[bool, ...]]:
    """The groups of blocks the local matching tiles: the windows (no axis flagged), then, unless the grid is
    2-D or less with an int radius on every axis (there the few tokens outside every window are matched by a
    gather, as before), for each set of axes flagged, the tokens past the last window on those axes only."""
    rank, extra = len(shape), [n - n // s * s for n, s in zip(shape, windows)]
    if rank <= 2 and all(rad is not None for rad in radii):
        return [(False,) * rank]
    flags = itertools.product((False, True), repeat=rank)
    return [(False,) * rank] + [f for f in flags if any(f) and all(e > 0 for e, a in zip(extra, f) if a)]


@table
def _tiling(shape: tuple[int, ...], windows: tuple[int, ...], radii: tuple, tiles: tuple[int, ...],
            device: torch.device):
    """Index tables of the local matching (cached: pure shape logic).

    The window grid is padded to whole tiles; a tile has ``P = prod(T_i) * S`` positions (its windows in
    raster order, each window's ``S`` tokens in choice order) and a neighbourhood of ``K = prod(T_i + 2 R_i)``
    windows (``R_i = 0`` on whole axes). The tokens outside every window form *slabs* (see ``_slabs``): on a
    flagged axis, a slab's block is the ``n_i - g_i s_i`` tokens past the last window, matched as if in it
    (tile 1, neighbourhood ``1 + 2 R_i``); its blocks are tiled on the other axes as the windows are. Returns:

    - ``groups``: for the windows, then each slab, ``(tokens, candidates, blocked)``:
      ``tokens`` ``(T, P)``: the grid token at each position (some token past the grid's windows);
      ``candidates`` ``(T, K)``: the window of each neighbourhood place (0 outside the grid, masked);
      ``blocked`` ``(T, P, K)``: whether that position's token may NOT match that window (it may when its own
      window and the candidate are inside the grid and at most ``R_i`` windows apart along each int axis);
    - ``outside`` ``(sum T * P,)``: whether a position holds no token of the grid (a window's, or a slab's);
    - ``first`` ``(W,)``: the flat position of each window's choice 0;
    - ``position`` ``(N,)``: the flat position of every token (the groups one after the other; the tokens
      ``rest`` come last, numbered in their order);
    - ``rest``: the tokens outside every window not in a slab (matched by a gather), as in ``window_split``.
    """
    cpu, rank = torch.device("cpu"), len(shape)
    grid, step = window_grid(shape, windows), strides(shape)
    num = math.prod(grid)
    pads = [0 if rad is None else rad for rad in radii]
    counts = [-(-g // t) for g, t in zip(grid, tiles)]  # tiles per axis
    padded = torch.full([c * t + 2 * p for c, t, p in zip(counts, tiles, pads)], num, dtype=torch.int64)
    padded[tuple(slice(p, p + g) for p, g in zip(pads, grid))] = torch.arange(num).view(grid)
    origin, offset, _, rest = _grid.__wrapped__(shape, windows, cpu)
    origin = torch.cat([origin, origin.new_zeros(1)])
    groups, insides, first = [], [], None
    for slab in _slabs(shape, windows, radii):
        last = [g - 1 if rad is not None else 0 for g, rad in zip(grid, radii)]  # where a slab's window is
        spans = [(g if rad is None else 1 + 2 * rad) if a else t + 2 * p
                 for a, g, rad, t, p in zip(slab, grid, radii, tiles, pads)]
        sizes = [1 if a else t for a, t in zip(slab, tiles)]  # windows (or slab blocks) per tile
        number = [1 if a else c for a, c in zip(slab, counts)]  # tiles per axis
        candidates = padded[tuple(slice(f, f + span) if a else slice(None) for a, f, span in zip(slab, last, spans))]
        for axis, (span, t) in enumerate(zip(spans, sizes)):
            candidates = candidates.unfold(axis, span, t)
        num_tiles, span_all, size = math.prod(number), math.prod(spans), math.prod(sizes)
        candidates = candidates.reshape(num_tiles, span_all)
        own = padded[tuple(slice(g - 1 + p, g + p) if a else slice(p, p + c * t)
                           for a, g, p, c, t in zip(slab, grid, pads, counts, tiles))]  # window of each place, or W
        own = own.reshape([n for ct in zip(number, sizes) for n in ct])
        own = own.permute(*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)).reshape(num_tiles, size)
        block = offset if not any(slab) else _raster(
            [n - g * s if a else s for a, n, g, s in zip(slab, shape, grid, windows)], step)  # tokens of a block
        shift = sum([s * t for a, s, t in zip(slab, windows, step) if a])  # a slab's block: past its window
        tokens = (origin[own].unsqueeze(2) + shift + block).reshape(num_tiles, size * block.shape[0])
        near = torch.ones([1] * (2 * rank), dtype=torch.bool)
        for axis, (t, span, p, rad) in enumerate(zip(sizes, spans, pads, radii)):
            if rad is not None:
                along = (torch.arange(t).unsqueeze(1) + p - torch.arange(span).unsqueeze(0)).abs() <= rad
                view = [1] * (2 * rank)
                view[axis], view[rank + axis] = t, span
                near = near & along.view(view)
        near = near.expand(*sizes, *spans).reshape(1, size, span_all)
        allowed = near & (candidates < num).unsqueeze(1) & (own < num).unsqueeze(2)  # (T, size, K)
        allowed = allowed.unsqueeze(2).expand(-1, -1, block.shape[0], -1).reshape(num_tiles, -1, span_all)
        places = own.reshape(-1) < num
        if first is None:
            first = torch.empty(num, dtype=torch.int64)
            first[own.reshape(-1)[places]] = torch.arange(places.shape[0])[places] * block.shape[0]
        insides.append(places.repeat_interleave(block.shape[0]))
        groups.append((tokens, candidates.masked_fill(candidates == num, 0), ~allowed))  # masked: any will do
    position, base = torch.empty(math.prod(shape), dtype=torch.int64), 0
    for (tokens, _, _), inside in zip(groups, insides):
        flat = tokens.reshape(-1)
        position[flat[inside]] = base + torch.arange(flat.shape[0])[inside]
        base += flat.shape[0]
    if len(groups) > 1:
        rest = rest[:0]  # in the slabs
    position[rest] = base + torch.arange(rest.shape[0])
    to = functools.partial(torch.Tensor.to, device=device)
    groups = tuple(tuple(to(t) for t in group) for group in groups)
    return groups, to(~torch.cat(insides)), to(first), to(position), to(rest)


@table
def _rest_candidates(shape: tuple[int, ...], windows: tuple[int, ...], radii: tuple, device: torch.device):
    """``(Nr, K)`` candidate destinations of the tokens outside every window (cached: pure shape logic).

    Such a token belongs to the nearest window; its candidates are the destinations of the windows at most
    ``R_i`` windows away along each axis (every window along a ``None`` axis), clamped at the borders (a
    repeated candidate changes no maximum). Destination ``i`` is window ``i``'s whatever the per-window choice.
    """
    rest = _grid.__wrapped__(shape, windows, torch.device("cpu"))[3]
    grid = window_grid(shape, windows)
    table = torch.zeros(rest.shape[0], 1, dtype=torch.int64)
    for coord, s, g, rad in zip(coords(rest, shape), windows, grid, radii):
        if rad is None:
            near = torch.arange(g).expand(rest.shape[0], g)
        else:
            near = ((coord // s).clamp(max=g - 1).unsqueeze(1) + torch.arange(-rad, rad + 1)).clamp(0, g - 1)
        table = (table.unsqueeze(2) * g + near.unsqueeze(1)).reshape(rest.shape[0], -1)
    return table.to(device)


def local_best_matches(src: torch.Tensor, dst: torch.Tensor, candidates: torch.Tensor, chunk: int | None = None):
    """``best_matches`` restricted to each source's candidate destinations ``(Ns, K)`` (a gather and a
    product: for the few tokens outside every window), ``chunk`` gathered elements at a time at most."""
    chunk = device_chunk(2**24, src.device) if chunk is None else chunk
    batch, num_src, channels = src.shape
    rows = max(1, chunk // max(1, batch * candidates.shape[1] * channels))
    values, picks = [], []
    for i in range(0, num_src, rows):
        cand = candidates[i: i + rows]
        near = dst.index_select(1, cand.reshape(-1)).view(batch, cand.shape[0], -1, channels)
        best, pick = (near * src[:, i: i + rows].unsqueeze(2)).sum(-1).max(dim=-1)  # (B, rows)
        values.append(best)
        picks.append(cand.expand(batch, -1, -1).gather(2, pick.unsqueeze(2)).squeeze(2))
    return (values[0], picks[0]) if len(values) == 1 else (torch.cat(values, 1), torch.cat(picks, 1))


@table
def _slices(fold: int, step: int, device: torch.device) -> torch.Tensor:
    """``(fold, 1)``: the shift of each slice of a folded grid, ``step`` apart."""
    return (torch.arange(fold) * step).unsqueeze(1).to(device)


def _folded(position: torch.Tensor, fold: int, places: int) -> torch.Tensor:
    """The positions of every token of ``fold`` slices side by side (slice ``f``'s shifted by ``f * places``)."""
    return (position + _slices(fold, places, position.device)).reshape(-1)


@table
def _rank_slots(num_src: int, r: int, device: torch.device):
    """``(merged, slot)`` ``(Ns,)`` by rank: whether the source ranked ``i`` is merged (``i < r``), and the slot
    of a kept one (``i - r``: the kept sources in rank order come first)."""
    rank = torch.arange(num_src)
    return (rank < r).to(device), (rank - r).to(device)


@table(maxsize=16)  # up to DENSE_LIMIT bytes each
def _far(shape: tuple[int, ...], windows: tuple[int, ...], radii: tuple, device: torch.device) -> torch.Tensor:
    """``(N, W)`` bool: whether token ``t`` may NOT match window ``w``'s destination: along some int axis ``i``
    the window is more than ``R_i`` windows from the token's own (a token outside every window belongs to the
    nearest window, as in ``_rest_candidates``). The same reach as the tiles'."""
    grid = window_grid(shape, windows)
    token = torch.arange(math.prod(shape))
    window = torch.arange(math.prod(grid))
    far = torch.zeros(token.shape[0], window.shape[0], dtype=torch.bool)
    for coord, wcoord, s, g, rad in zip(coords(token, shape), coords(window, grid), windows, grid, radii):
        if rad is not None:
            far |= ((coord // s).clamp(max=g - 1).unsqueeze(1) - wcoord.unsqueeze(0)).abs() > rad
    return far.to(device)


def use_dense(tokens: int, windows: int, device: torch.device, dense: bool | None = None) -> bool:
    """Whether local matching scores every token against every destination (masked to its reach): off the CPU,
    for grids of at most ``DENSE_LIMIT`` scores; ``dense`` forces it either way."""
    return (not _on_cpu(device) and tokens * windows <= DENSE_LIMIT) if dense is None else dense


def _dense_matching(metric: torch.Tensor, dst_metric: torch.Tensor, dst: torch.Tensor, shape, windows, radii, r: int,
                    outer: int) -> torch.Tensor:
    """``dest`` ``(outer, fold * N)`` of the local matching computed as one product (see ``DENSE_LIMIT``).

    ``metric`` ``(outer * fold, N, C)``, ``dst_metric`` its normalised destinations ``(outer * fold, W, C)``,
    ``dst`` ``(fold or 1, W)`` their tokens. Sources are ranked together over the slices; kept ones take the
    first slots in rank order, then the destinations in window order (slice by slice), as in the global matching.
    """
    batch, tokens, _ = metric.shape
    fold, device = batch // outer, metric.device
    windows_each = dst.shape[1]
    scores = (metric @ dst_metric.transpose(1, 2)).masked_fill_(_far(shape, windows, radii, device), -torch.inf)
    best, window = scores.max(dim=-1)  # (B * fold, N): each token's nearest destination in reach
    best = best / metric.norm(dim=-1).clamp_min_(torch.finfo(metric.dtype).tiny)
    best = best.view(outer, -1, tokens)  # (outer, fold, N): the destinations' own scores set to -inf (ranked last)
    best = best.scatter_(2, dst.expand(outer, fold, -1), -torch.inf).view(outer, -1)
    if fold > 1:
        window = window.view(outer, fold, -1) + _slices(fold, windows_each, device)
    num_src = fold * (tokens - windows_each)
    kept = num_src - r
    order = best.argsort(dim=-1, descending=True)
    merged, kept_slot = _rank_slots(best.shape[1], r, device)
    slot_of_rank = torch.where(merged, window.reshape(outer, -1).gather(1, order) + kept, kept_slot)
    dest = torch.empty_like(order).scatter_(1, order, slot_of_rank)
    every = (dst if fold == 1 else (dst + _slices(fold, tokens, device))).reshape(-1)
    return dest.index_copy_(1, every, arange(kept + fold * windows_each, device)[kept:].expand(outer, -1))


def local_soft_matching(metric: torch.Tensor, shape, windows, r: int, offsets: torch.Tensor | None, radius,
                        chunk: int | None = None, tile=None, fold: int = 1, dense: bool | None = None) -> MergePlan:
    """ToMe's plan with every source matched only against the destinations of the windows within ``radius``
    (a tuple: an int or ``None`` per axis) on a grid ``shape`` with ``windows`` (see ``windows.py``).

    ``fold``: the metric holds ``fold`` such grids one after the other (``(B, fold * N, C)``: the leading axes
    of a larger grid, each slice matched on its own); they are matched as a batch of ``B * fold`` and ranked
    together, slots numbered as on the whole grid (windows in raster order, the slices one after the other).

    Each tile's tokens (gathered straight from ``metric``, destinations included and masked after) are scored
    against its neighbourhood's destinations in a dense product. Only the destinations are normalised: a
    source's best match does not depend on its own norm, so its best score is divided by it afterwards. The
    ``(B, N, C)`` metric is copied once, a chunk at a time, and never normalised whole.

    ``dense``: score every token against every destination instead, the windows out of reach masked (default:
    off the CPU, for grids small enough; see ``DENSE_LIMIT``). The same candidates; kept sources are then
    numbered in rank order (as in the global matching) instead of position order.
    """
    shape, windows, radii = tuple(shape), tuple(windows), tuple(radius)
    outer, all_tokens, channels = metric.shape
    batch, tokens, device = outer * fold, all_tokens // fold, metric.device
    chunk = device_chunk(LOCAL_CHUNK, device) if chunk is None else chunk
    tiles = tile_sizes(window_grid(shape, windows), radii, tile)
    windows_each = math.prod(window_grid(shape, windows))
    num_windows = windows_each * fold
    num_src = all_tokens - num_windows
    r = min(r, num_src)
    kept = num_src - r
    groups, outside, first, position, rest = _tiling(shape, windows, radii, tiles, device)
    metric = metric.reshape(batch, tokens, channels)  # the slices of a folded grid side by side in the batch
    if offsets is not None:
        offsets = offsets.view(fold, windows_each)
    dst = window_dst(shape, windows, offsets, device).view(-1, windows_each)  # (fold or 1, W)
    if dst.shape[0] == 1:  # the same destinations in every slice
        dst_metric = metric.index_select(1, dst[0])
    else:  # (outer, fold, W, C): slice f's own destinations
        dst_metric = metric.view(outer, fold, tokens, channels).gather(
            2, dst.view(1, fold, windows_each, 1).expand(outer, -1, -1, channels)).view(batch, -1, channels)
    dst_metric = dst_metric / dst_metric.norm(dim=-1, keepdim=True)
    if use_dense(tokens, windows_each, device, dense):
        dest = _dense_matching(metric, dst_metric, dst, shape, windows, radii, r, outer)
        return MergePlan(dest, kept + num_windows)
    tiny = torch.finfo(metric.dtype).tiny
    values, matched = [], []
    for at, candidates, blocked in groups:
        (num_tiles, places), span = at.shape, candidates.shape[1]
        step = max(1, chunk // max(1, batch * places * (channels + span)))
        for i in range(0, num_tiles, step):
            cand = candidates[i: i + step]
            x = metric.index_select(1, at[i: i + step].reshape(-1)).view(batch, -1, places, channels)
            near = dst_metric.index_select(1, cand.reshape(-1)).view(batch, -1, span, channels)
            scores = (x @ near.transpose(2, 3)).masked_fill_(blocked[i: i + step], -torch.inf)  # (B, n, P, K)
            best, pick = scores.max(dim=-1)
            values.append((best / x.norm(dim=-1).clamp_min_(tiny)).view(batch, -1))
            matched.append(cand.expand(batch, -1, -1).gather(2, pick).view(batch, -1))
    best, window = (torch.cat(v, 1) if len(v) > 1 else v[0] for v in (values, matched))
    if offsets is None:  # every windowed token but the destinations is a source
        other = outside.index_fill(0, first, True).expand(fold, -1)
    else:
        other = outside.expand(fold, -1).scatter(1, first + offsets, True)
    if rest.shape[0]:  # tokens outside every window: each against the windows near its own
        rest_metric = metric.index_select(1, rest)
        rest_metric = rest_metric / rest_metric.norm(dim=-1, keepdim=True)
        table = _rest_candidates(shape, windows, radii, device)
        rest_best, rest_window = local_best_matches(rest_metric, dst_metric, table)
        best, window = torch.cat([best, rest_best], 1), torch.cat([window, rest_window], 1)
        other = torch.cat([other, other.new_zeros(other.shape[0], rest.shape[0])], 1)
    if fold > 1:  # the slices side by side: positions, windows and tokens of slice f shifted by f slices
        window = (window.view(outer, fold, -1) + _slices(fold, windows_each, device)).view(outer, -1)
        best = best.view(outer, -1)
        position = _folded(position, fold, other.shape[1])
        dst = (dst + _slices(fold, tokens, device)).reshape(-1)
    other = other.reshape(1, -1)  # (1, positions): a destination, or no token of the grid
    best = best.masked_fill(other, -torch.inf)
    merged = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(r, dim=-1).indices, True)
    # a kept source: neither merged nor another (merged ones are sources); kept ones numbered in position order
    slot = torch.where(merged, window + kept, (merged == other).cumsum(1) - 1)  # by position
    dest = slot.index_select(1, position)  # by token
    dest.index_copy_(1, dst.reshape(-1), arange(kept + num_windows, device)[kept:].expand(outer, -1))
    return MergePlan(dest, kept + num_windows)


def local_soft_matching_2d(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, r: int,
                           offsets: torch.Tensor | None, radius: int, chunk: int | None = None,
                           tile: int | None = None) -> MergePlan:
    """``local_soft_matching`` of an ``h`` x ``w`` grid with ``sy`` x ``sx`` windows and one ``radius``
    (``bipartite_soft_matching_2d(..., radius=radius)``)."""
    return local_soft_matching(metric, (h, w), (sy, sx), r, offsets, (radius, radius), chunk=chunk, tile=tile)
