"""ToMe's bipartite soft matching (ToMe for SD, Sec. 3-4) on token grids of any rank, and its random choice of
destinations.

The tokens of a grid (2-D ``(h, w)`` for images, 3-D ``(frames, h, w)`` for video) are split into destinations
(one per window, chosen at random or the window's first token) and sources (all the others, including the tokens
a window does not cover when the windows do not divide the grid; see ``windows.py``). Every source is matched
with its most similar destination (cosine similarity) among those in reach; the ``r`` best-matched sources over the
whole grid are averaged into their destinations.

Reach: ``radius=None`` (ToMe's global matching) compares every source with every destination; an int ``R`` only
with the destinations of the windows at most ``R`` windows away along each axis (linear cost). The local matching
runs one of two ways: *tiles* (the windows cut into tiles, each tile's tokens scored against its neighbourhood's
destinations: O(N) work, the CPU's way) or *dense* (every token against every destination, the windows out of reach
masked by a table: a handful of kernels, the GPU's way for grids whose scores fit ``DENSE_LIMIT``).

A ``Matching`` holds what a grid decides once (reach per axis, folded axes, the way, the chunk sizes); calling it
with a metric makes a plan (``soft_matching.py``: the same as one function call, tomesd's way). Everything is
tensor code on the input's device: no host synchronisation, no global RNG.
All of the library's hash constants are here: the random destination choice is a pure function of (seed, block,
timestep).
"""

from __future__ import annotations

import math
import operator

import torch

from .plan import TABLES, IdentityPlan, MergePlan, Tables, arange
from .windows import (
    check_grid,
    choice_tables,
    far,
    rank_slots,
    rest_candidates,
    slices,
    tile_sizes,
    tiling,
    top_left,
    window_grid,
)

__all__ = ["Matching", "GlobalMatching", "LocalMatching", "matching", "best_matches", "normalize_radius",
           "random_offsets", "window_split", "window_destinations", "mix32", "block_salts", "window_hashes",
           "step_key", "PATHS"]

# ---- the random destination choice: every hash constant of the library ----------------------------------------
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # a window's part of the choice: window * _GOLDEN
_SEED_MIX = 0x85EBCA6B  # the seed's part
_BLOCK_MIX = 0xC2B2AE35  # a block's salt: index * _BLOCK_MIX


def mix32(x):
    """A 32-bit integer hash (lowbias32) on int64 tensors or Python ints: uniform, device-independent."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def window_hashes(num_windows: int, device: torch.device) -> torch.Tensor:
    """``(W,)`` int64: ``window * 0x9E3779B1 mod 2**32``, the window's part of the random choice (a table)."""
    return ((torch.arange(num_windows, dtype=torch.int64) * _GOLDEN) & _MASK32).to(device)


def random_offsets(num_windows: int, choices: int, key, device: torch.device, tables: Tables = TABLES):
    """One offset in ``[0, choices)`` per window, a pure function of ``key``:
    ``lowbias32((window * 0x9E3779B1 + key) mod 2**32) % choices``.

    Args:
        key: a Python int or an int64 tensor (on ``device``) identifying the draw (seed, block and timestep mixed
            together): one element, or ``(..., 1)`` for several draws at once (the result is then ``(..., W)``).
    """
    return mix32((tables.get(window_hashes, num_windows, torch.device(device)) + key) & _MASK32) % choices


def seed_key(seed: int) -> int:
    """The seed's part of every draw."""
    return mix32((seed * _SEED_MIX) & _MASK32)


def block_salts(seed: int, blocks: int, device: torch.device) -> torch.Tensor:
    """``(blocks, 1)`` int64: each block's salt, ``seed_key(seed) ^ (index * 0xC2B2AE35)`` (a table)."""
    key = seed_key(seed)
    return torch.tensor([[key ^ ((index * _BLOCK_MIX) & _MASK32)] for index in range(blocks)],
                        dtype=torch.int64).to(device)


def step_key(timestep, device: torch.device):
    """An integer identifying the denoising step (``round(64 t) mod 2**32``), without reading device memory on the
    host: a Python int, or a one-element int64 tensor for a tensor timestep (its largest value: a timestep may hold
    one value per token, 0 on clean conditioning tokens)."""
    if timestep is None:  # no timestep to key on: one fixed pattern, still reproducible
        return 0
    if isinstance(timestep, torch.Tensor):
        t = timestep.reshape(-1).amax(0, keepdim=True).to(device=device, dtype=torch.float32)
        return (t * 64).round().to(torch.int64) & _MASK32
    return int(round(float(timestep) * 64)) & _MASK32


# ---- destinations and sources ---------------------------------------------------------------------------------
def window_split(shape, windows, offsets: torch.Tensor | None, device, tables: Tables = TABLES):
    """Token indices ``(dst, src)`` of the grid for the given per-window choice (``None``: choice 0).

    ``dst`` ``(W,)``: each window's destination, in window order. ``src`` ``(N - W,)``: the other tokens of
    each window (window by window, in choice order), then the tokens outside every window in raster order.
    ``offsets`` may have leading dimensions ``(..., W)`` (one draw per folded grid): then so do both.
    """
    device = torch.device(device)
    shape, windows = tuple(shape), tuple(windows)
    if offsets is None:
        return tables.get(top_left, shape, windows, device)
    tokens, others, rest = tables.get(choice_tables, shape, windows, device)
    tokens = tokens.expand(*offsets.shape, tokens.shape[1])
    dst = tokens.gather(-1, offsets.unsqueeze(-1)).squeeze(-1)
    src = tokens.gather(-1, others[offsets]).flatten(-2)
    return dst, (torch.cat([src, rest.expand(*src.shape[:-1], -1)], -1) if rest.shape[0] else src)


def window_dst(shape, windows, offsets: torch.Tensor | None, device, tables: Tables = TABLES) -> torch.Tensor:
    """``window_split(...)[0]`` alone: each window's destination token (``(..., W)``)."""
    device = torch.device(device)
    shape, windows = tuple(shape), tuple(windows)
    if offsets is None:
        return tables.get(top_left, shape, windows, device)[0]
    tokens = tables.get(choice_tables, shape, windows, device)[0]
    return tokens.expand(*offsets.shape, tokens.shape[1]).gather(-1, offsets.unsqueeze(-1)).squeeze(-1)


def window_destinations(h: int, w: int, sx: int, sy: int, offsets: torch.Tensor | None, device):
    """``window_split`` of an ``h`` x ``w`` grid with ``sy`` x ``sx`` windows (the 2-D API)."""
    return window_split((h, w), (sy, sx), offsets, device)


# ---- how a device runs the matching -----------------------------------------------------------------------------
# Scores computed at once, at most (elements), on the CPU: sources are taken in chunks of rows, so a (B, Ns, Nd)
# matrix (3.2 GB per image at 2048 px for SD 1.5) is never held whole, and each chunk's maximum is taken while the
# chunk is still in cache. LOCAL_CHUNK: the elements a tile batch handles at once (its copies stay small and in cache,
# no temporary near the size at which allocators map fresh pages, 32 MB for glibc).
SCORE_CHUNK = 2**22
LOCAL_CHUNK = 2**20
# Off the CPU (CUDA, MPS) a chunk is kernels to launch, each costing the host about as much as a small kernel runs:
# products are taken whole, up to GPU_CHUNK elements (512 MB of fp16 scores) at once, and a grid whose (tokens x
# windows) scores fit DENSE_LIMIT elements is matched densely.
GPU_CHUNK = 2**28
DENSE_LIMIT = 2**22
PATHS = ("cpu", "cuda")  # the code paths: the CPU's (tiles, chunks) and every other device's


def _paths(paths: str | None, device: torch.device) -> str:
    if paths is None:
        return "cpu" if torch.device(device).type == "cpu" else "cuda"
    if paths not in PATHS:
        raise ValueError(f"code paths must be one of {', '.join(PATHS)} (or None: the device's); got {paths!r}")
    return paths


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


class Matching:
    """ToMe's matching on one token grid: what the grid decides once (``matching`` makes the right one), and
    ``__call__`` per plan (``run``: the algorithm, for callers that checked the call themselves).

    Attributes: ``shape``, ``windows``, ``radius`` (per axis, after folding), ``fold`` (grids one after the other in
    the metric: leading axes matched slice by slice), ``tokens``, ``num_windows`` (per slice), ``empty`` (no window
    fits: nothing can merge), ``tables``, ``chunk``.
    """

    def __init__(self, shape, windows, radius, fold: int, device, paths: str | None, tables: Tables,
                 chunk: int | None = None):
        on_cpu = _paths(paths, device) == "cpu"
        self.shape, self.windows, self.radius, self.fold, self.tables = shape, windows, radius, fold, tables
        self.tokens = fold * math.prod(shape)
        self.num_windows = math.prod(window_grid(shape, windows))
        self.empty = self.num_windows == 0
        self.on_cpu = on_cpu

    def __call__(self, metric: torch.Tensor, r: int, offsets: torch.Tensor | None = None):
        """The plan merging ``r`` sources of ``metric`` ``(B, N, C)`` (features on the grid's tokens) into their best
        destinations; ``offsets`` ``(W,)`` (or one row per folded slice) the destination choice of each window
        (``None``: choice 0). An ``IdentityPlan`` when ``r <= 0`` or no window fits."""
        tokens = metric.shape[1]
        if tokens != self.tokens:
            folded = f" (x {self.fold})" if self.fold > 1 else ""
            raise RuntimeError(f"token merging: {tokens} tokens do not form the expected "
                               f"{' x '.join(map(str, self.shape))} grid{folded}")
        if r <= 0 or self.empty:
            return IdentityPlan(tokens)
        with torch.no_grad():
            return self.run(metric, r, offsets)

    def run(self, metric: torch.Tensor, r: int, offsets: torch.Tensor | None) -> MergePlan:
        raise NotImplementedError


def matching(shape, windows, radius=None, device="cpu", paths: str | None = None, tables: Tables = TABLES) -> Matching:
    """The matching of a token grid: ``GlobalMatching`` where the radius covers every axis, else ``LocalMatching``.

    Args:
        shape: the token grid (tokens in raster order).
        windows: window size per axis.
        radius: ``None`` (global), an int (that many windows away on every axis) or one per axis.
        device: where the metric will be.
        paths: "cpu" or "cuda" (every non-CPU device): how the matching runs (tiles and chunks, or dense and
            whole products); ``None``: the device's.
        tables: where its index tables are kept (a patch's own store, or the shared one).

    Example:
        >>> m = matching((8, 8), (2, 2), radius=1)
        >>> m(torch.randn(2, 64, 16), r=32).num_slots
        32
    """
    shape, windows = check_grid(shape, windows)
    device = torch.device(device)
    uniform = radius is not None and not isinstance(radius, (tuple, list))  # one int for every axis
    given, radius = radius, normalize_radius(radius, shape, windows)
    axes = _folded_axes(shape, windows, radius)
    shape, windows, radius, fold = shape[axes:], windows[axes:], radius[axes:], math.prod(shape[:axes])
    if all(rad is None for rad in radius):
        return GlobalMatching(shape, windows, radius, fold, device, paths, tables)
    if uniform and len(shape) == 2:  # one radius on a 2-D grid: as given, even on an axis it covers (the tiling,
        radius = (operator.index(given),) * 2  # and so the plan, of the 2-D API)
    return LocalMatching(shape, windows, radius, fold, device, paths, tables)


class GlobalMatching(Matching):
    """ToMe's global matching: every source against every destination (of its slice when the grid is folded: the
    metric then holds ``fold`` grids one after the other, ranked together). Slots: the kept sources in rank order,
    then the destinations in window order."""

    def __init__(self, shape, windows, radius, fold, device, paths=None, tables: Tables = TABLES, chunk=None):
        super().__init__(shape, windows, radius, fold, device, paths, tables)
        self.chunk = (SCORE_CHUNK if self.on_cpu else GPU_CHUNK) if chunk is None else chunk

    def run(self, metric: torch.Tensor, r: int, offsets) -> MergePlan:
        batch, tokens, channels = metric.shape
        device, fold, tables = metric.device, self.fold, self.tables
        if offsets is None:
            dst, src = tables.get(top_left, self.shape, self.windows, device)
        else:  # each window's chosen destination, and its other tokens (window_split)
            choice, others, rest = tables.get(choice_tables, self.shape, self.windows, device)
            offsets = offsets.view(fold, self.num_windows) if fold > 1 else offsets
            choice = choice.expand(*offsets.shape, choice.shape[1])
            dst = choice.gather(-1, offsets.unsqueeze(-1)).squeeze(-1)
            src = choice.gather(-1, others[offsets]).flatten(-2)
            src = torch.cat([src, rest.expand(*src.shape[:-1], -1)], -1) if rest.shape[0] else src
        if fold > 1:  # token indices over the whole grid, slice by slice
            shift = tables.get(slices, fold, tokens // fold, device)
            dst, src = (dst + shift).reshape(-1), (src + shift).reshape(-1)
        num_src, num_dst = src.shape[0], dst.shape[0]
        r = min(r, num_src)
        metric = metric / metric.norm(dim=-1, keepdim=True)
        src_metric = metric.index_select(1, src).view(batch * fold, -1, channels)
        dst_metric = metric.index_select(1, dst).view(batch * fold, -1, channels)
        if max(1, self.chunk // max(1, src_metric.shape[0] * dst_metric.shape[1])) >= src_metric.shape[1]:
            best, best_dst = (src_metric @ dst_metric.transpose(1, 2)).max(dim=-1)  # (B * fold, Ns / fold): each
        else:  # slice on its own; scores a chunk of rows at a time
            best, best_dst = best_matches(src_metric, dst_metric, self.chunk)
        if fold > 1:
            best = best.view(batch, -1)
            best_dst = (best_dst.view(batch, fold, -1) + tables.get(slices, fold, self.num_windows, device)).view(
                batch, -1)
        order = best.argsort(dim=-1, descending=True)  # (B, Ns): merged sources first
        kept = num_src - r
        # Slot layout of the merged sequence: [kept sources in `order` ... | destinations in grid order].
        merged, kept_slot = tables.get(rank_slots, num_src, r, device)
        slot_of_rank = torch.where(merged, best_dst.gather(1, order) + kept, kept_slot)  # (B, Ns): the source ranked i
        dest = torch.empty(batch, tokens, dtype=torch.int64, device=device)
        dest.index_copy_(1, src, torch.empty_like(order).scatter_(1, order, slot_of_rank))
        dest.index_copy_(1, dst, (tables.get(arange, kept + num_dst, device)[kept:]).expand(batch, num_dst))
        return MergePlan(dest, kept + num_dst, tables)


class LocalMatching(Matching):
    """The local matching (see the module): every source against the destinations of the windows in reach, dense
    (``dense``) or tile by tile. The metric may hold ``fold`` grids one after the other (``(B, fold * N, C)``): they
    are matched as a batch of ``B * fold`` and ranked together, slots numbered as on the whole grid (windows in
    raster order, the slices one after the other).

    Only the destinations are normalised: a source's best match does not depend on its own norm, so its best score
    is divided by it afterwards. The ``(B, N, C)`` metric is copied once, a chunk at a time, and never normalised
    whole. Dense: kept sources are numbered in rank order (as in the global matching); tiles: in position order.
    An axis whose radius is ``None`` is taken whole by each tile.
    """

    def __init__(self, shape, windows, radius, fold, device, paths=None, tables: Tables = TABLES,
                 dense: bool | None = None, tile=None, chunk: int | None = None):
        super().__init__(shape, windows, radius, fold, device, paths, tables)
        self.dense = (not self.on_cpu and math.prod(shape) * self.num_windows <= DENSE_LIMIT) if dense is None \
            else dense
        self.tiles = tile_sizes(window_grid(shape, windows), radius, tile)
        self.chunk = (LOCAL_CHUNK if self.on_cpu else GPU_CHUNK) if chunk is None else chunk
        self.rest_chunk = 2**24 if self.on_cpu else GPU_CHUNK

    def run(self, metric: torch.Tensor, r: int, offsets) -> MergePlan:
        shape, windows, radii, fold, tables = self.shape, self.windows, self.radius, self.fold, self.tables
        outer, all_tokens, channels = metric.shape
        batch, tokens, device = outer * fold, all_tokens // fold, metric.device
        windows_each = self.num_windows
        num_windows = windows_each * fold
        num_src = all_tokens - num_windows
        r = min(r, num_src)
        kept = num_src - r
        metric = metric.reshape(batch, tokens, channels)  # the slices of a folded grid side by side in the batch
        if offsets is not None:
            offsets = offsets.view(fold, windows_each)
        dst = window_dst(shape, windows, offsets, device, tables).view(-1, windows_each)  # (fold or 1, W)
        if dst.shape[0] == 1:  # the same destinations in every slice
            dst_metric = metric.index_select(1, dst[0])
        else:  # (outer, fold, W, C): slice f's own destinations
            dst_metric = metric.view(outer, fold, tokens, channels).gather(
                2, dst.view(1, fold, windows_each, 1).expand(outer, -1, -1, channels)).view(batch, -1, channels)
        dst_metric = dst_metric / dst_metric.norm(dim=-1, keepdim=True)
        if self.dense:  # one product, the windows out of reach masked
            scores = (metric @ dst_metric.transpose(1, 2)).masked_fill_(tables.get(far, shape, windows, radii, device),
                                                                        -torch.inf)
            best, window = scores.max(dim=-1)  # (B * fold, N): each token's nearest destination in reach
            best = best / metric.norm(dim=-1).clamp_min_(torch.finfo(metric.dtype).tiny)
            best = best.view(outer, -1, tokens)  # (outer, fold, N): destinations' own scores -inf (ranked last)
            best = best.scatter_(2, dst.expand(outer, fold, -1), -torch.inf).view(outer, -1)
            if fold > 1:
                window = window.view(outer, fold, -1) + tables.get(slices, fold, windows_each, device)
            order = best.argsort(dim=-1, descending=True)
            merged, kept_slot = tables.get(rank_slots, best.shape[1], r, device)
            slot_of_rank = torch.where(merged, window.reshape(outer, -1).gather(1, order) + kept, kept_slot)
            dest = torch.empty_like(order).scatter_(1, order, slot_of_rank)
            every = (dst if fold == 1 else (dst + tables.get(slices, fold, tokens, device))).reshape(-1)
            dest.index_copy_(1, every, tables.get(arange, kept + num_windows, device)[kept:].expand(outer, -1))
            return MergePlan(dest, kept + num_windows, tables)
        groups, outside, first, position, rest = tables.get(tiling, shape, windows, radii, self.tiles, device)
        tiny = torch.finfo(metric.dtype).tiny
        values, matched = [], []
        for at, candidates, blocked in groups:
            (num_tiles, places), span = at.shape, candidates.shape[1]
            step = max(1, self.chunk // max(1, batch * places * (channels + span)))
            for i in range(0, num_tiles, step):
                cand = candidates[i: i + step]
                x = metric.index_select(1, at[i: i + step].reshape(-1)).view(batch, -1, places, channels)
                near = dst_metric.index_select(1, cand.reshape(-1)).view(batch, -1, span, channels)
                scores = (x @ near.transpose(2, 3)).masked_fill_(blocked[i: i + step], -torch.inf)  # (B, n, P, K)
                best, pick = scores.max(dim=-1)
                values.append((best / x.norm(dim=-1).clamp_min_(tiny)).view(batch, -1))
                matched.append(cand.expand(batch, -1, -1).gather(2, pick).view(batch, -1))
        best = torch.cat(values, 1) if len(values) > 1 else values[0]
        window = torch.cat(matched, 1) if len(matched) > 1 else matched[0]
        if offsets is None:  # every windowed token but the destinations is a source
            other = outside.index_fill(0, first, True).expand(fold, -1)
        else:
            other = outside.expand(fold, -1).scatter(1, first + offsets, True)
        if rest.shape[0]:  # tokens outside every window: each against the windows near its own
            rest_metric = metric.index_select(1, rest)
            rest_metric = rest_metric / rest_metric.norm(dim=-1, keepdim=True)
            table = tables.get(rest_candidates, shape, windows, radii, device)
            rest_best, rest_window = local_best_matches(rest_metric, dst_metric, table, self.rest_chunk)
            best, window = torch.cat([best, rest_best], 1), torch.cat([window, rest_window], 1)
            other = torch.cat([other, other.new_zeros(other.shape[0], rest.shape[0])], 1)
        if fold > 1:  # the slices side by side: positions, windows and tokens of slice f shifted by f slices
            window = (window.view(outer, fold, -1) + tables.get(slices, fold, windows_each, device)).view(outer, -1)
            best = best.view(outer, -1)
            position = (position + tables.get(slices, fold, other.shape[1], device)).reshape(-1)
            dst = (dst + tables.get(slices, fold, tokens, device)).reshape(-1)
        other = other.reshape(1, -1)  # (1, positions): a destination, or no token of the grid
        best = best.masked_fill(other, -torch.inf)
        merged = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(r, dim=-1).indices, True)
        # a kept source: neither merged nor another (merged ones are sources); kept ones numbered in position order
        slot = torch.where(merged, window + kept, (merged == other).cumsum(1) - 1)  # by position
        dest = slot.index_select(1, position)  # by token
        dest.index_copy_(1, dst.reshape(-1), tables.get(arange, kept + num_windows, device)[kept:].expand(outer, -1))
        return MergePlan(dest, kept + num_windows, tables)


def best_matches(src: torch.Tensor, dst: torch.Tensor, chunk: int = SCORE_CHUNK):
    """For each source row, the highest similarity to any destination and which: ``(B, Ns)`` values, indices.

    ``src`` ``(B, Ns, C)`` and ``dst`` ``(B, Nd, C)`` are unit vectors; scores are their dot products, ``chunk``
    elements at a time at most.
    """
    batch, num_src, num_dst = src.shape[0], src.shape[1], dst.shape[1]
    rows = max(1, chunk // max(1, batch * num_dst))
    dst_t = dst.transpose(1, 2)
    if rows >= num_src:
        return (src @ dst_t).max(dim=-1)
    parts = [(src[:, i: i + rows] @ dst_t).max(dim=-1) for i in range(0, num_src, rows)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def local_best_matches(src: torch.Tensor, dst: torch.Tensor, candidates: torch.Tensor, chunk: int = 2**24):
    """``best_matches`` restricted to each source's candidate destinations ``(Ns, K)`` (a gather and a
    product: for the few tokens outside every window), ``chunk`` gathered elements at a time at most."""
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
