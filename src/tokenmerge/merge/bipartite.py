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
    "bipartite_soft_matching_2d", "best_matches", "windowed_best_matches", "window_destinations", "random_offsets",
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


@functools.lru_cache(maxsize=256)
def _tiles(hsy: int, wsx: int, sources: int, radius: int, tile: int, device: torch.device):
    """Index tables of the windows cut into ``tile`` x ``tile`` tiles (cached: pure shape logic).

    Returns ``(candidates, allowed)``: ``(T, span^2)`` the destination (window) index of each position of
    the ``span = tile + 2 * radius`` neighbourhood of each tile (``hsy * wsx``, one past the last, outside
    the grid), and
    ``(T, tile^2 * sources, span^2)`` whether each of the tile's sources may match each of them (its own
    window at most ``radius`` windows away, inside the grid).
    """
    ty, tx, span = -(-hsy // tile), -(-wsx // tile), tile + 2 * radius
    grid = torch.full((ty * tile + 2 * radius, tx * tile + 2 * radius), hsy * wsx, dtype=torch.int64)
    grid[radius: radius + hsy, radius: radius + wsx] = torch.arange(hsy * wsx).view(hsy, wsx)
    candidates = grid.unfold(0, span, tile).unfold(1, span, tile).reshape(ty * tx, span * span)
    near = (torch.arange(tile).unsqueeze(1) + radius - torch.arange(span).unsqueeze(0)).abs() <= radius
    near = (near[:, None, :, None] & near[None, :, None, :]).reshape(tile * tile, 1, span * span)
    near = near.expand(-1, sources, -1).reshape(1, tile * tile * sources, span * span)
    allowed = near & (candidates < hsy * wsx).unsqueeze(1)
    return candidates.to(device), allowed.to(device)


def local_best_matches(src: torch.Tensor, dst: torch.Tensor, candidates: torch.Tensor):
    """``best_matches`` restricted to each source's candidate destinations ``(Ns, K)`` (a gather and a
    product: for the few tokens outside every window)."""
    batch, num_src, channels = src.shape
    near = dst.index_select(1, candidates.reshape(-1)).view(batch, num_src, -1, channels)
    best, pick = (near * src.unsqueeze(2)).sum(-1).max(dim=-1)  # (B, Ns)
    return best, candidates.expand(batch, -1, -1).gather(2, pick.unsqueeze(2)).squeeze(2)


def windowed_best_matches(src: torch.Tensor, dst: torch.Tensor, hsy: int, wsx: int, radius: int,
                          chunk: int | None = None):
    """``best_matches`` of the windowed sources, each against the destinations of the windows at most
    ``radius`` windows away: ``(B, hsy * wsx * S)`` values and indices for ``src`` ``(B, hsy * wsx * S, C)``
    in window order (``S`` sources a window) and ``dst`` ``(B, hsy * wsx, C)``.

    The windows are cut into tiles; each tile's sources are scored against its neighbourhood's destinations
    with one batched matmul (``tile^2 * S`` x ``span^2`` per tile) and the ones out of reach are masked:
    ``O(N)`` work in dense products instead of the global matching's ``O(N^2)``.
    """
    chunk = SCORE_CHUNK if chunk is None else chunk
    batch, _, channels = src.shape
    sources = src.shape[1] // (hsy * wsx)
    if radius == 0:  # one candidate, the own window's destination: a row-wise dot product, no tiles
        best = (src.view(batch, hsy * wsx, sources, channels) * dst.unsqueeze(2)).sum(-1)
        index = torch.arange(hsy * wsx, device=src.device).repeat_interleave(sources)
        return best.view(batch, -1), index.expand(batch, -1)
    tile = max(4, 2 * radius)
    ty, tx = -(-hsy // tile), -(-wsx // tile)
    candidates, allowed = _cached(_tiles)(hsy, wsx, sources, radius, tile, src.device)
    num_tiles, span2 = candidates.shape
    grid = src.view(batch, hsy, wsx, sources, channels)
    grid = torch.nn.functional.pad(grid, (0, 0, 0, 0, 0, tx * tile - wsx, 0, ty * tile - hsy))
    tiles = grid.view(batch, ty, tile, tx, tile, sources, channels).permute(0, 1, 3, 2, 4, 5, 6)
    tiles = tiles.reshape(batch, num_tiles, tile * tile * sources, channels)
    padded = torch.cat([dst, dst.new_zeros(batch, 1, channels)], 1)  # outside the grid: a zero row, masked
    rows = max(1, chunk // max(1, batch * tiles.shape[2] * span2))
    values, indices = [], []
    for i in range(0, num_tiles, rows):
        cand = candidates[i: i + rows]
        near = padded.index_select(1, cand.reshape(-1)).view(batch, cand.shape[0], span2, channels)
        scores = (tiles[:, i: i + rows] @ near.transpose(2, 3)).masked_fill_(~allowed[i: i + rows], -torch.inf)
        best, pick = scores.max(dim=-1)  # (B, n, tile^2 * S)
        values.append(best)
        indices.append(cand.expand(batch, -1, -1).gather(2, pick))
    best, index = (torch.cat(v, 1) if len(v) > 1 else v[0] for v in (values, indices))

    def untile(t):
        t = t.view(batch, ty, tx, tile, tile, sources).permute(0, 1, 3, 2, 4, 5)
        return t.reshape(batch, ty * tile, tx * tile, sources)[:, :hsy, :wsx].reshape(batch, -1)

    return untile(best), untile(index)


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
    if r <= 0 or (h // sy) * (w // sx) == 0:
        return IdentityPlan()
    with torch.no_grad():
        dst, src = window_destinations(h, w, sx, sy, offsets, metric.device)
        num_src, num_dst = src.shape[0], dst.shape[0]
        r = min(r, num_src)
        metric = metric / metric.norm(dim=-1, keepdim=True)
        src_metric, dst_metric = metric.index_select(1, src), metric.index_select(1, dst)
        hsy, wsx = h // sy, w // sx
        if radius is None or radius >= max(hsy, wsx) - 1:
            best, best_dst = best_matches(src_metric, dst_metric)  # (B, Ns)
        else:
            windowed = hsy * wsx * (sx * sy - 1)
            best, best_dst = windowed_best_matches(src_metric[:, :windowed], dst_metric, hsy, wsx, radius)
            if num_src > windowed:  # tokens outside every window
                table = _cached(_rest_candidates)(h, w, sx, sy, radius, metric.device)
                rest = local_best_matches(src_metric[:, windowed:], dst_metric, table)
                best, best_dst = torch.cat([best, rest[0]], 1), torch.cat([best_dst, rest[1]], 1)
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
