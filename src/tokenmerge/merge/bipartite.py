"""Bipartite soft matching with one destination token per ``sx`` x ``sy`` window (ToMe for SD, Sec. 3-4).

The tokens of an ``h`` x ``w`` grid are split into destinations (one per window, chosen at random or
top-left) and sources (all the others, including the rows and columns a window does not cover when
``sx``/``sy`` do not divide the grid). Every source is matched with its most similar destination (cosine
similarity); the ``r`` best-matched sources are averaged into their destinations.

Everything here is tensor code on the input's device: no host synchronisation, no global RNG.
"""

from __future__ import annotations

import functools

import torch

from .plan import IdentityPlan, MergePlan

__all__ = [
    "bipartite_soft_matching_2d", "local_soft_matching_2d", "best_matches", "window_destinations", "random_offsets",
]

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


@functools.lru_cache(maxsize=256)
def _grid(h: int, w: int, sx: int, sy: int, device: torch.device):
    """Index tables of an ``h`` x ``w`` grid cut into ``sy`` x ``sx`` windows (cached: pure shape logic)."""
    hsy, wsx = h // sy, w // sx
    choices = sx * sy
    origin = (torch.arange(hsy).unsqueeze(1) * (sy * w) + torch.arange(wsx).unsqueeze(0) * sx).reshape(-1)
    offset = torch.tensor([(k // sx) * w + (k % sx) for k in range(choices)])  # token offset of choice k
    others = torch.tensor([[j for j in range(choices) if j != k] for k in range(choices)])  # (S, S-1)
    # tokens outside every window (always sources), in grid order: the right columns of the covered rows, then
    # the rows below (no data-dependent ops: torch.compile traces this when it ignores the cache)
    right = (torch.arange(hsy * sy).unsqueeze(1) * w + torch.arange(wsx * sx, w).unsqueeze(0)).reshape(-1)
    rest = torch.cat([right, torch.arange(hsy * sy * w, h * w)])
    to = functools.partial(torch.Tensor.to, device=device)
    return to(origin), to(offset), to(offset[others]), to(rest)


def _cached(fn):
    """``fn`` under its cache, or the bare function while torch.compile traces (it bakes the tables in)."""
    return fn.__wrapped__ if torch.compiler.is_compiling() else fn


def window_destinations(h: int, w: int, sx: int, sy: int, offsets: torch.Tensor | None, device):
    """Token indices ``(dst, src)`` of the grid for the given per-window choice (``None``: top-left)."""
    device = torch.device(device)
    if offsets is None:
        return _cached(_top_left)(h, w, sx, sy, device)
    origin, offset, other_offsets, rest = _cached(_grid)(h, w, sx, sy, device)
    dst = origin + offset[offsets]
    src = (origin.unsqueeze(1) + other_offsets[offsets]).reshape(-1)
    return dst, torch.cat([src, rest])


@functools.lru_cache(maxsize=256)
def _top_left(h: int, w: int, sx: int, sy: int, device: torch.device):
    origin, offset, other_offsets, rest = _grid.__wrapped__(h, w, sx, sy, device)
    src = (origin.unsqueeze(1) + other_offsets[0]).reshape(-1)
    return origin + offset[0], torch.cat([src, rest])


# Similarity scores computed at once, at most (elements): above, sources are taken in chunks of rows, so the
# (B, Ns, Nd) matrix (3.2 GB per image at 2048 px for SD 1.5) is never held whole, and each chunk's maximum is
# taken while the chunk is still in cache. Every row is the same computation either way (same results).
SCORE_CHUNK = 2**22


def best_matches(src: torch.Tensor, dst: torch.Tensor, chunk: int | None = None):
    """For each source row, the highest similarity to any destination and which: ``(B, Ns)`` values, indices.

    ``src`` ``(B, Ns, C)`` and ``dst`` ``(B, Nd, C)`` are unit vectors; scores are their dot products.
    """
    chunk = SCORE_CHUNK if chunk is None else chunk
    batch, num_src, num_dst = src.shape[0], src.shape[1], dst.shape[1]
    rows = max(1, chunk // max(1, batch * num_dst))
    dst_t = dst.transpose(1, 2)
    if rows >= num_src:
        return (src @ dst_t).max(dim=-1)
    parts = [(src[:, i: i + rows] @ dst_t).max(dim=-1) for i in range(0, num_src, rows)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


@functools.lru_cache(maxsize=256)
def _rest_candidates(h: int, w: int, sx: int, sy: int, radius: int, device: torch.device):
    """``(Nr, K)`` candidate destinations of the tokens outside every window (cached: pure shape logic).

    Such a token belongs to the nearest window; its candidates are the destinations of the windows at most
    ``radius`` windows away in each direction, clamped at the borders (a repeated candidate changes no
    maximum). Destination ``i`` is window ``i``'s whatever the per-window choice.
    """
    hsy, wsx = h // sy, w // sx
    rest = _grid.__wrapped__(h, w, sx, sy, torch.device("cpu"))[3]
    wy = (rest // w // sy).clamp(max=hsy - 1).unsqueeze(1) + torch.arange(-radius, radius + 1)
    wx = (rest % w // sx).clamp(max=wsx - 1).unsqueeze(1) + torch.arange(-radius, radius + 1)
    table = wy.clamp(0, hsy - 1).unsqueeze(2) * wsx + wx.clamp(0, wsx - 1).unsqueeze(1)
    return table.reshape(rest.shape[0], -1).to(device)


def local_best_matches(src: torch.Tensor, dst: torch.Tensor, candidates: torch.Tensor):
    """``best_matches`` restricted to each source's candidate destinations ``(Ns, K)`` (a gather and a
    product: for the few tokens outside every window)."""
    batch, num_src, channels = src.shape
    near = dst.index_select(1, candidates.reshape(-1)).view(batch, num_src, -1, channels)
    best, pick = (near * src.unsqueeze(2)).sum(-1).max(dim=-1)  # (B, Ns)
    return best, candidates.expand(batch, -1, -1).gather(2, pick.unsqueeze(2)).squeeze(2)


# Local matching cuts the windows into tiles of LOCAL_TILE x LOCAL_TILE windows (at least 2 * radius) and
# scores each tile's tokens against its neighbourhood's destinations in one small product. LOCAL_CHUNK: the
# elements (gathered tokens and scores) handled at once, at most, so that a chunk's copies stay small and in
# cache and no temporary is near the size at which allocators map fresh pages (32 MB for glibc).
LOCAL_TILE = 4
LOCAL_CHUNK = 2**20


@functools.lru_cache(maxsize=256)
def _tiling(h: int, w: int, sx: int, sy: int, radius: int, tile: int, device: torch.device):
    """Index tables of the local matching (cached: pure shape logic).

    The window grid is padded to whole ``tile`` x ``tile`` tiles; a tile has ``P = tile^2 * S`` positions (its
    windows in row order, each window's ``S`` tokens in choice order ``k = dy * sx + dx``) and a neighbourhood
    of ``K = (tile + 2 * radius)^2`` windows. Returns:

    - ``tokens`` ``(T, P)``: the grid token at each position (window 0's tokens past the grid's windows);
    - ``candidates`` ``(T, K)``: the window of each neighbourhood place (0 outside the grid, masked);
    - ``blocked`` ``(T, P, K)``: whether that position's token may NOT match that window (it may when its own
      window and the candidate are inside the grid and at most ``radius`` windows apart in each direction);
    - ``inside`` ``(T * P,)``: whether a position belongs to a window inside the grid;
    - ``first`` ``(W,)``: the flat position (over ``T * P``) of each window's choice 0;
    - ``position`` ``(N,)``: the flat position of every token; the tokens outside every window come last,
      numbered from ``T * P`` in the order of ``rest``;
    - ``rest``: those tokens (as in ``window_destinations``).
    """
    cpu = torch.device("cpu")
    hsy, wsx, choices = h // sy, w // sx, sx * sy
    windows, span = hsy * wsx, tile + 2 * radius
    ty, tx = -(-hsy // tile), -(-wsx // tile)
    grid = torch.full((ty * tile + 2 * radius, tx * tile + 2 * radius), windows, dtype=torch.int64)
    grid[radius: radius + hsy, radius: radius + wsx] = torch.arange(windows).view(hsy, wsx)
    candidates = grid.unfold(0, span, tile).unfold(1, span, tile).reshape(ty * tx, span * span)
    own = grid[radius: radius + ty * tile, radius: radius + tx * tile]  # window of each tile place, or W
    own = own.reshape(ty, tile, tx, tile).permute(0, 2, 1, 3).reshape(ty * tx, tile * tile)
    origin, offset, _, rest = _grid.__wrapped__(h, w, sx, sy, cpu)
    origin = torch.cat([origin, origin.new_zeros(1)])
    tokens = (origin[own].unsqueeze(2) + offset).reshape(ty * tx, tile * tile * choices)
    near = (torch.arange(tile).unsqueeze(1) + radius - torch.arange(span).unsqueeze(0)).abs() <= radius
    near = (near[:, None, :, None] & near[None, :, None, :]).reshape(1, tile * tile, span * span)
    allowed = near & (candidates < windows).unsqueeze(1) & (own < windows).unsqueeze(2)  # (T, tile^2, K)
    allowed = allowed.unsqueeze(2).expand(-1, -1, choices, -1).reshape(ty * tx, -1, span * span)
    places = own.reshape(-1) < windows
    first = torch.empty(windows, dtype=torch.int64)
    first[own.reshape(-1)[places]] = torch.arange(places.shape[0])[places] * choices
    inside = places.repeat_interleave(choices)
    flat = tokens.reshape(-1)
    position = torch.empty(h * w, dtype=torch.int64)
    position[flat[inside]] = torch.arange(flat.shape[0])[inside]
    position[rest] = flat.shape[0] + torch.arange(rest.shape[0])
    candidates = candidates.masked_fill(candidates == windows, 0)  # masked: any window will do
    to = functools.partial(torch.Tensor.to, device=device)
    return tuple(to(t) for t in (tokens, candidates, ~allowed, inside, first, position, rest))


def local_soft_matching_2d(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, r: int,
                           offsets: torch.Tensor | None, radius: int, chunk: int | None = None,
                           tile: int | None = None) -> MergePlan:
    """ToMe's plan with every source matched only against the destinations of the windows at most ``radius``
    windows away: ``bipartite_soft_matching_2d(..., radius=radius)`` (see there) for a grid with windows.

    ``O(N)`` work: each tile's tokens (gathered straight from ``metric``, destinations included and masked
    after) are scored against its neighbourhood's destinations in a dense product. Only the destinations are
    normalised: a source's best match does not depend on its own norm, so its best score is divided by it
    afterwards. The ``(B, N, C)`` metric is copied once, a chunk at a time, and never normalised whole.
    """
    chunk = LOCAL_CHUNK if chunk is None else chunk
    tile = max(LOCAL_TILE if tile is None else tile, 2 * radius, 1)
    batch, tokens, channels = metric.shape
    device = metric.device
    windows = (h // sy) * (w // sx)
    num_src = tokens - windows
    r = min(r, num_src)
    kept = num_src - r
    at, candidates, blocked, inside, first, position, rest = _cached(_tiling)(h, w, sx, sy, radius, tile, device)
    num_tiles, places = at.shape
    span2 = candidates.shape[1]
    flat = metric.reshape(batch * tokens, channels)
    base = torch.arange(batch, device=device)

    def rows(source, index, per):  # (B * index.numel(), C): rows ``index`` of every batch element of ``source``
        return source.index_select(0, (index + base.view(batch, *[1] * index.dim()) * per).reshape(-1))

    dst = window_destinations(h, w, sx, sy, offsets, device)[0]
    dst_metric = rows(flat, dst, tokens).view(batch, windows, channels)
    dst_metric = dst_metric / dst_metric.norm(dim=-1, keepdim=True)
    dst_flat = dst_metric.view(-1, channels)
    tiny = torch.finfo(metric.dtype).tiny
    step = max(1, chunk // max(1, batch * places * (channels + span2)))
    values, matched = [], []
    for i in range(0, num_tiles, step):
        cand = candidates[i: i + step]
        x = rows(flat, at[i: i + step], tokens).view(batch, -1, places, channels)
        near = rows(dst_flat, cand, windows).view(batch, -1, span2, channels)
        scores = (x @ near.transpose(2, 3)).masked_fill_(blocked[i: i + step], -torch.inf)  # (B, n, P, K)
        best, pick = scores.max(dim=-1)
        values.append(best / x.norm(dim=-1).clamp_min_(tiny))
        matched.append(cand.expand(batch, -1, -1).gather(2, pick))
    best, window = (torch.cat(v, 1).view(batch, -1) for v in (values, matched))
    choice = torch.zeros_like(first) if offsets is None else offsets
    source = inside.index_fill(0, first + choice, False)  # every windowed token but the destinations
    if rest.shape[0]:  # tokens outside every window: each against the windows near its own
        rest_metric = rows(flat, rest, tokens).view(batch, -1, channels)
        rest_metric = rest_metric / rest_metric.norm(dim=-1, keepdim=True)
        table = _cached(_rest_candidates)(h, w, sx, sy, radius, device)
        rest_best, rest_window = local_best_matches(rest_metric, dst_metric, table)
        best, window = torch.cat([best, rest_best], 1), torch.cat([window, rest_window], 1)
        source = torch.cat([source, source.new_ones(rest.shape[0])])
    best = best.masked_fill(~source, -torch.inf)
    merged = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(r, dim=-1).indices, True)
    slot = torch.where(merged, kept + window, (source & ~merged).cumsum(1) - 1)  # by position
    dest = slot.index_select(1, position)  # by token
    dest.index_copy_(1, dst, (kept + torch.arange(windows, device=device)).expand(batch, windows))
    return MergePlan(dest, kept + windows)


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
    """Build the merge plan of ToMe for SD.

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
    batch, tokens, _ = metric.shape
    if tokens != h * w:
        raise RuntimeError(f"token merging: {tokens} tokens do not form the expected {h} x {w} grid")
    hsy, wsx = h // sy, w // sx
    if r <= 0 or hsy * wsx == 0:
        return IdentityPlan()
    with torch.no_grad():
        if radius is not None and radius < max(hsy, wsx) - 1:
            return local_soft_matching_2d(metric, h, w, sx, sy, r, offsets, radius)
        dst, src = window_destinations(h, w, sx, sy, offsets, metric.device)
        num_src, num_dst = src.shape[0], dst.shape[0]
        r = min(r, num_src)
        metric = metric / metric.norm(dim=-1, keepdim=True)
        best, best_dst = best_matches(metric.index_select(1, src), metric.index_select(1, dst))  # (B, Ns)
        order = best.argsort(dim=-1, descending=True)  # (B, Ns): merged sources first
        kept = num_src - r
        # Slot layout of the merged sequence: [kept sources in `order` ... | destinations in grid order].
        slot_of_rank = torch.arange(num_src, device=metric.device).expand(batch, num_src)
        slot_of_rank = torch.where(
            slot_of_rank < r, kept + best_dst.gather(1, order), slot_of_rank - r
        )  # (B, Ns): slot of the source ranked i
        src_slot = torch.empty_like(order).scatter_(1, order, slot_of_rank)  # (B, Ns) by source position
        dest = torch.empty(batch, tokens, dtype=torch.int64, device=metric.device)
        dest.index_copy_(1, src, src_slot)
        dest.index_copy_(1, dst, (kept + torch.arange(num_dst, device=metric.device)).expand(batch, num_dst))
        return MergePlan(dest, kept + num_dst)
