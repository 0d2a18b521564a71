"""MergePlan: where every token goes when merged, and how to bring it back."""

from __future__ import annotations

import torch

from .windows import arange, table

__all__ = ["MergePlan", "IdentityPlan"]


@table
def _ones(n: int, device: torch.device) -> torch.Tensor:
    """``(n,)`` float32 ones kept on ``device`` (a slot's token count is a sum of them)."""
    return torch.ones(n, dtype=torch.float32).to(device)


@table
def _starts(batch: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """``(B, 1)``: where each element's slots start in the flattened ``(B * M)`` merged tokens."""
    return (torch.arange(batch) * num_slots).unsqueeze(1).to(device)


class IdentityPlan:
    """The exact fast path: nothing is merged, inputs pass through untouched (bit for bit).

    ``num_tokens`` (and ``num_slots``, the same): the grid's token count when the matcher knows it, else None.
    """

    num_merged = 0

    def __init__(self, num_tokens: int | None = None):
        self.num_tokens = self.num_slots = num_tokens

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return x


class MergePlan:
    """A many-to-one map from ``N`` tokens onto ``M`` merged tokens, the same for every channel.

    It is stored as one index per token (``dest``: the slot of the merged sequence a token lands in), so
    merging is a single ``index_add`` (a mean over each slot) and unmerging a single ``index_select``
    (every token reads back its slot). Both work for any trailing channel count and any float dtype. A plan made
    for batch 1 applies to every element of a batch of any size (one pattern for all, along the token axis);
    a plan made for batch ``B`` maps each element its own way.

    Args:
        dest: ``(B, N)`` int64, values in ``[0, M)``; every slot receives at least one token.
        num_slots: ``M``.
    """

    def __init__(self, dest: torch.Tensor, num_slots: int):
        batch, tokens = dest.shape
        self.batch, self.num_tokens, self.num_slots = batch, tokens, num_slots
        self.num_merged = tokens - num_slots
        self.dest = dest
        device = dest.device
        # (B * N,): each token's slot in the flattened (B * M) merged tokens
        self.flat_dest = dest.reshape(-1) if batch == 1 else (dest + _starts(batch, num_slots, device)).reshape(-1)
        counts = torch.zeros(batch * num_slots, device=device, dtype=torch.float32)
        counts.index_add_(0, self.flat_dest, _ones(batch * tokens, device))
        self._inv_counts = counts.reciprocal_().unsqueeze(1)  # (B*M, 1)
        self._inv_counts_by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def expand(self, batch: int) -> "MergePlan":
        """This batch-1 plan applied to every element of a batch of ``batch`` (one pattern for all): itself, which
        merges a batch of any size that way."""
        if self.batch != 1:
            raise ValueError(f"expand needs a plan made for batch 1, this one has batch {self.batch}")
        return self

    def representatives(self) -> torch.Tensor:
        """``(B, M)``: for each slot, the lowest index of the tokens merged into it (its position's owner).

        ``amin`` is order-independent, so the answer is the same on every device and run.
        """
        dest = self.dest
        tokens = arange(self.num_tokens, dest.device).expand_as(dest)
        out = torch.full((self.batch, self.num_slots), self.num_tokens, device=dest.device, dtype=dest.dtype)
        return out.scatter_reduce(1, dest, tokens, "amin")

    def _check(self, x: torch.Tensor, tokens: int, what: str) -> None:
        if x.dim() != 3 or (x.shape[0] != self.batch and self.batch != 1) or x.shape[1] != tokens:
            raise RuntimeError(
                f"token merging: {what} expects a (batch={self.batch}, tokens={tokens}, channels) tensor, "
                f"got shape {tuple(x.shape)}"
            )

    def _inv(self, dtype: torch.dtype) -> torch.Tensor:
        inv = self._inv_counts_by_dtype.get(dtype)
        if inv is None:
            inv = self._inv_counts_by_dtype[dtype] = self._inv_counts.to(dtype)
        return inv

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, C) -> (B, M, C)``: each slot is the mean of the tokens that land in it."""
        self._check(x, self.num_tokens, "merge")
        batch, _, channels = x.shape
        if self.batch == 1:  # one pattern for the batch: along the token axis
            out = x.new_zeros(batch, self.num_slots, channels).index_add_(1, self.flat_dest, x)
            return out * self._inv(x.dtype)
        out = x.new_zeros(self.batch * self.num_slots, channels).index_add_(0, self.flat_dest, x.reshape(-1, channels))
        return (out * self._inv(x.dtype)).view(self.batch, self.num_slots, channels)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, M, C) -> (B, N, C)``: each token takes the value of its slot."""
        self._check(x, self.num_slots, "unmerge")
        if self.batch == 1:
            return x.index_select(1, self.flat_dest)
        channels = x.shape[2]
        out = x.reshape(-1, channels).index_select(0, self.flat_dest)
        return out.view(self.batch, self.num_tokens, channels)
