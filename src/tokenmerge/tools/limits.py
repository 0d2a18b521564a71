"""The zero-overhead limits the bench measures against: stand-ins for a merge or a pooling that cost nothing.

``limit`` (ToMe's) keeps the first ``M`` tokens a merge would leave and repeats them back; ``todo-limit`` (ToDo's)
takes the first tokens of the pooled count as keys and values. Their outputs are meaningless as images: they are
the best speed any merge or pooling to that token count could reach, so a method's share of the limit's gain is
what its own overhead leaves. They are handed to the core through ``apply_config(matcher=...)`` and
``apply_config(downsampler=...)`` with the signatures of the engine's N-D matcher and downsampler.

Example:
    >>> import torch
    >>> plan = slice_match(torch.zeros(1, 16, 4), (4, 4), (2, 2), 8)
    >>> plan.num_slots, plan.merge(torch.zeros(1, 16, 4)).shape
    (8, torch.Size([1, 8, 4]))
"""

from __future__ import annotations

import math

import torch

from ..merge import TABLES, IdentityPlan, pooled_shape
from ..merge.plan import Sided, join

__all__ = ["SlicePlan", "slice_match", "slice_downsample"]


class SlicePlan(Sided):
    """The zero-overhead reference ("limit"): keep the first ``M`` tokens, repeat them back to ``N``.

    Not a merge (its output is meaningless as an image); it costs nothing to build or apply, so the attention
    on ``M`` tokens is all that is left: the best speed any merge to ``M`` tokens could reach.

    Args:
        num_tokens: ``N``, the tokens before the "merge".
        num_slots: ``M``, the tokens kept.
        device: where ``representatives`` is made.
    """

    batch = 1  # one pattern for every sample
    tables = TABLES  # where the rotary rows' index tables are kept (the shared store: no patch owns a limit's)

    def __init__(self, num_tokens: int, num_slots: int, device=None):
        self.num_tokens, self.num_slots = num_tokens, num_slots
        self.num_merged = num_tokens - num_slots
        self._repeat = -(-num_tokens // num_slots)
        self.device = device
        self._reps: torch.Tensor | None = None

    def representatives(self) -> torch.Tensor:
        """``(1, M)``: the merged token ``i`` is token ``i`` (the first ``M`` tokens keep their own positions), so
        rotary positions and mask entries follow a limit as they follow a real merge (``MergePlan``)."""
        if self._reps is None:
            self._reps = torch.arange(self.num_slots, device=torch.device(self.device or "cpu")).unsqueeze(0)
        return self._reps

    def merge(self, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        """``(B, N, C) -> (B, M, C)``: the first ``M`` tokens (a view); the tokens ``before`` and ``after`` them
        as they are."""
        if before or after:
            return join(x, x[:, before: before + self.num_slots], before, after)
        return x[:, : self.num_slots]

    def unmerge(self, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        """``(B, M, C) -> (B, N, C)``: each kept token repeated, cut to ``N``; the tokens ``before`` and ``after``
        them as they are."""
        whole, sided = x, before or after
        if sided:
            x = x[:, before: x.shape[1] - after]
        b, m, c = x.shape
        out = x.unsqueeze(2).expand(b, m, self._repeat, c).reshape(b, m * self._repeat, c)[:, : self.num_tokens]
        return join(whole, out, before, after) if sided else out


def slice_match(metric, shape, windows, r, offsets=None, radius=None):
    """A matcher with ToMe's token count after merging (``r`` capped at the number of sources), on a grid of
    any rank (``bipartite_soft_matching``'s arguments; ``offsets`` and ``radius`` change nothing)."""
    tokens = metric.shape[1]
    num = math.prod([n // s for n, s in zip(shape, windows)])
    r = min(r, tokens - num)
    return IdentityPlan(tokens) if r <= 0 or num == 0 else SlicePlan(tokens, tokens - r, metric.device)


def slice_downsample(x: torch.Tensor, shape: tuple[int, ...], factors: tuple[int, ...],
                     mode: str = "nearest-exact") -> torch.Tensor:
    """ToDo's zero-overhead reference (the bench's "todo-limit"): the first ``prod(pooled)`` tokens, a free view.

    Not a downsampling (the keys/values it gives are meaningless): the attention on the pooled count is all that
    is left, the best speed any pooling to that count could reach.
    """
    return x if all(f == 1 for f in factors) else x[:, : math.prod(pooled_shape(shape, factors))]
