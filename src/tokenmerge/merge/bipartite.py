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

__all__ = ["bipartite_soft_matching_2d", "best_matches", "window_destinations", "random_offsets"]

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


def window_destinations(h: int, w: int, sx: int, sy: int, offsets: torch.Tensor | None, device):
    """Token indices ``(dst, src)`` of the grid for the given per-window choice (``None``: top-left)."""
    device = torch.device(device)
    # torch.compile traces the functions under their caches (and bakes the tables into the graph)
    compiling = torch.compiler.is_compiling()
    if offsets is None:
        return (_top_left.__wrapped__ if compiling else _top_left)(h, w, sx, sy, device)
    origin, offset, other_offsets, rest = (_grid.__wrapped__ if compiling else _grid)(h, w, sx, sy, device)
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


def bipartite_soft_matching_2d(
    metric: torch.Tensor,
    h: int,
    w: int,
    sx: int,
    sy: int,
    r: int,
    offsets: torch.Tensor | None = None,
):
    """Build the merge plan of ToMe for SD.

    Args:
        metric: ``(B, N, C)`` features the similarity is measured on, ``N == h * w``.
        h, w: the token grid.
        sx, sy: window size.
        r: number of tokens to remove (capped at the number of sources).
        offsets: ``(num_windows,)`` int64 choice of destination in each window (``k = dy * sx + dx``),
            or ``None`` for top-left.

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
