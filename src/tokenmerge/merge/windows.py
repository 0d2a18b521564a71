"""Index tables of a token grid of any rank cut into windows, one destination token per window: pure shape logic,
built once per key (``tables.Tables``) and read by the matching (``match.py``).

A grid ``shape = (n_0, ..., n_{d-1})`` holds its tokens in raster order (row-major: for a video grid ``(F, H, W)``
token ``(f, y, x)`` is ``(f * H + y) * W + x``). ``windows = (s_0, ..., s_{d-1})`` cuts it into ``n_i // s_i``
windows per axis, numbered in raster order over the window grid; a window's ``S = prod(s_i)`` tokens (its
*choices*) are numbered row-major over the window's axes (2-D ``(sy, sx)``: ``k = dy * sx + dx``). The tokens past
the last whole window on some axis (a coordinate ``>= (n_i // s_i) * s_i``) belong to no window: they are always
sources.

The local matching's tables (``tiling``, ``rest_candidates``, ``far``) are here too: for each token, the windows in
reach (``match.py`` explains the matching). Each is built once per key and kept in a ``plan.Tables`` store.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

__all__ = ["num_windows", "window_grid", "check_grid", "tile_sizes", "top_left", "choice_tables", "tiling",
           "rest_candidates", "far", "slices", "rank_slots"]

# Local matching cuts the windows into tiles of LOCAL_TILE windows per axis (2-D; at least 2 * radius) and scores
# each tile's tokens against its neighbourhood's destinations in one small product.
LOCAL_TILE = 4


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


def _others(choices: int) -> torch.Tensor:
    """``(S, S - 1)``: the choices but ``k``, in order, for each choice ``k``."""
    j = torch.arange(choices - 1).unsqueeze(0)
    return j + (j >= torch.arange(choices).unsqueeze(1)).long()


def grid_tables(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    """``(origin, offset, other_offsets, rest)``: each window's first token ``(W,)``, the token offset of each
    choice ``(S,)``, of the other choices of each choice ``(S, S - 1)``, the tokens outside every window."""
    grid, step = window_grid(shape, windows), strides(shape)
    origin = _raster(grid, [s * t for s, t in zip(windows, step)])
    offset = _raster(windows, step)
    rest = _rest(shape, [g * s for g, s in zip(grid, windows)])
    to = functools.partial(torch.Tensor.to, device=device)
    return to(origin), to(offset), to(offset[_others(offset.shape[0])]), to(rest)


def top_left(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    """``(dst, src)`` when every window's destination is its choice 0."""
    origin, _, other_offsets, rest = grid_tables(shape, windows, device)
    src = (origin.unsqueeze(1) + other_offsets[0]).reshape(-1)
    return origin, torch.cat([src, rest])


def choice_tables(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    """``(tokens, others, rest)``: the token of each window's each choice ``(W, S)``, the other choices of each
    choice ``(S, S - 1)``, the tokens outside every window."""
    origin, offset, _, rest = grid_tables(shape, windows, torch.device("cpu"))
    others = _others(offset.shape[0])
    return (origin.unsqueeze(1) + offset).to(device), others.to(device), rest.to(device)


# ---- the local matching's tables ----------------------------------------------------------------------------
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


def tiling(shape: tuple[int, ...], windows: tuple[int, ...], radii: tuple, tiles: tuple[int, ...],
           device: torch.device):
    """Index tables of the local matching.

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
    origin, offset, _, rest = grid_tables(shape, windows, cpu)
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


def rest_candidates(shape: tuple[int, ...], windows: tuple[int, ...], radii: tuple, device: torch.device):
    """``(Nr, K)`` candidate destinations of the tokens outside every window.

    Such a token belongs to the nearest window; its candidates are the destinations of the windows at most
    ``R_i`` windows away along each axis (every window along a ``None`` axis), clamped at the borders (a
    repeated candidate changes no maximum). Destination ``i`` is window ``i``'s whatever the per-window choice.
    """
    rest = grid_tables(shape, windows, torch.device("cpu"))[3]
    grid = window_grid(shape, windows)
    table = torch.zeros(rest.shape[0], 1, dtype=torch.int64)
    for coord, s, g, rad in zip(coords(rest, shape), windows, grid, radii):
        if rad is None:
            near = torch.arange(g).expand(rest.shape[0], g)
        else:
            near = ((coord // s).clamp(max=g - 1).unsqueeze(1) + torch.arange(-rad, rad + 1)).clamp(0, g - 1)
        table = (table.unsqueeze(2) * g + near.unsqueeze(1)).reshape(rest.shape[0], -1)
    return table.to(device)


def far(shape: tuple[int, ...], windows: tuple[int, ...], radii: tuple, device: torch.device) -> torch.Tensor:
    """``(N, W)`` bool: whether token ``t`` may NOT match window ``w``'s destination: along some int axis ``i``
    the window is more than ``R_i`` windows from the token's own (a token outside every window belongs to the
    nearest window, as in ``rest_candidates``). The same reach as the tiles'."""
    grid = window_grid(shape, windows)
    token = torch.arange(math.prod(shape))
    window = torch.arange(math.prod(grid))
    blocked = torch.zeros(token.shape[0], window.shape[0], dtype=torch.bool)
    for coord, wcoord, s, g, rad in zip(coords(token, shape), coords(window, grid), windows, grid, radii):
        if rad is not None:
            blocked |= ((coord // s).clamp(max=g - 1).unsqueeze(1) - wcoord.unsqueeze(0)).abs() > rad
    return blocked.to(device)


def slices(fold: int, step: int, device: torch.device) -> torch.Tensor:
    """``(fold, 1)``: the shift of each slice of a folded grid, ``step`` apart."""
    return (torch.arange(fold) * step).unsqueeze(1).to(device)


def rank_slots(num_src: int, r: int, device: torch.device):
    """``(merged, slot)`` ``(Ns,)`` by rank: whether the source ranked ``i`` is merged (``i < r``), and the slot
    of a kept one (``i - r``: the kept sources in rank order come first)."""
    rank = torch.arange(num_src)
    return (rank < r).to(device), (rank - r).to(device)
