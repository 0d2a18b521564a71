"""Merge plans (where every token goes when merged, and how to bring it back), and the store of the index tables
plans are made with.

Index tables are tensors computed from shapes alone (window origins, reach masks, slot numbers...): a ``Tables``
store builds each once per key and keeps it on its device. Each installed patch owns one (``remove_patch`` releases
it, with its device memory); ``TABLES``, bounded, serves direct calls of the ``tokenmerge.merge`` functions.

Under ``torch.compile`` a table is not traced (a traced ``arange * 0x9E3779B1`` becomes int32 index arithmetic inside
a kernel, and tables would be rebuilt at every call): ``traced_constant`` runs the store's build for real while
dynamo traces, and dynamo keeps the result as a constant of the graph (loaded from memory, a static address for
CUDA graphs). The engine reads a call's position ids on the host the same way (``engine/grids.py``). This module is
the only place with that machinery: one function marked ``assume_constant_result`` (by hand, so that importing
tokenmerge does not import dynamo), which calls into registered objects by key (dynamo passes it Python constants
and real tensors only).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict

import torch

from . import kernels as triton_kernels

__all__ = ["MergePlan", "IdentityPlan", "Tables", "TABLES", "traced_constant", "register", "join", "Sided",
           "sided_rows"]

# objects whose methods a traced constant runs (table stores, grid readers), by key
_REGISTERED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_keys = itertools.count(1)
_calls = 0


def register(obj) -> int:
    """A key by which ``traced_constant`` reaches ``obj`` (kept while ``obj`` lives)."""
    key = next(_keys)
    _REGISTERED[key] = obj
    return key


def traced_constant(key: int, method: str, *args):
    """``getattr(obj, method)(*args)`` of the object registered as ``key``, run for real while dynamo traces (its
    ``args``: Python constants, or tensors, which dynamo hands over with their real values); dynamo keeps the result
    (tensors, tuples of ints) as a constant of the graph.

    Dynamo names each such constant after the function, and inductor refuses two constants of one graph with one
    name: each call renames this function's code for the next one (a Python counter that runs at trace time, where
    no guard reads it)."""
    global _calls
    _calls += 1
    traced_constant.__code__ = traced_constant.__code__.replace(co_name=f"_tokenmerge_constant_{_calls}")
    return getattr(_REGISTERED[key], method)(*args)


traced_constant._dynamo_marked_constant = True


def _symbolic(key) -> bool:
    """Whether ``key`` holds a symbolic size (torch.compile with dynamic shapes): then the table is traced."""
    return any(_symbolic(k) if isinstance(k, (tuple, list)) else isinstance(k, torch.SymInt) for k in key)


class Tables:
    """Tables built by ``build(*key)`` (pure shape logic: ints, tuples and devices in, tensors out), kept per
    ``(build, key)``, the ``maxsize`` most recent. A ``build`` marked ``takes_tables`` is called ``build(store,
    *key)``: a table made from another of the store's.

    Example:
        >>> tables = Tables()
        >>> tables.get(torch.arange, 4).tolist()
        [0, 1, 2, 3]
    """

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        self._built: OrderedDict = OrderedDict()
        self.key = register(self)

    def get(self, build, *key):
        """``build(*key)``, from the store (built on first use)."""
        if torch.compiler.is_compiling():  # a constant of the graph; traced where the key is symbolic
            return self._build(build, key) if _symbolic(key) else traced_constant(self.key, "_make", build, key)
        value = self._built.get((build, key))
        return self._make(build, key) if value is None else value

    def _make(self, build, key):
        """Build (or find) a table outside tracing: a miss of ``get``, or what a traced constant runs."""
        value = self._built.get((build, key))
        if value is None:
            value = self._built[(build, key)] = self._build(build, key)
            if len(self._built) > self.maxsize:
                self._built.popitem(last=False)
        return value

    def _build(self, build, key):
        return build(self, *key) if getattr(build, "takes_tables", False) else build(*key)

    def clear(self) -> None:
        """Drop every table (and the device memory it holds)."""
        self._built.clear()

    def __len__(self) -> int:
        return len(self._built)


# direct calls of tokenmerge.merge's functions (a patch uses its own store)
TABLES = Tables()


def arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64) on ``device`` (a table: never written to)."""
    return torch.arange(n, dtype=torch.int64).to(device)


def sided_rows(index: torch.Tensor, before: int, count: int, after: int, tables: Tables = TABLES,
               lead: torch.Tensor | None = None) -> torch.Tensor:
    """Row numbers of ``[before | index | after]`` in a sequence of ``before + count + after`` rows: the ``before``
    rows (or the rows ``lead`` of them), ``index`` (rows of the ``count`` image rows) shifted past them, the ``after``
    rows behind the image; ``index`` itself where nothing sits beside it. Its leading axes (a plan's rows, ``(P, n)``)
    carry over."""
    if not (before or after):
        return index
    lead_axes, rows = index.shape[:-1], tables.get(arange, before + count + after, index.device)
    first = rows[:before].expand(*lead_axes, before) if lead is None else lead
    return torch.cat([first, index + before, rows[before + count:].expand(*lead_axes, after)], -1)


def _minus_ones(n: int, device) -> torch.Tensor:
    """``(n,)`` int64 -1 (a table)."""
    return torch.full((n,), -1, dtype=torch.int64).to(device)


def _ones(n: int, device: torch.device) -> torch.Tensor:
    """``(n,)`` float32 ones on ``device`` (a slot's token count is a sum of them; a table)."""
    return torch.ones(n, dtype=torch.float32).to(device)


def _starts(batch: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """``(B, 1)``: where each element's slots start in the flattened ``(B * M)`` merged tokens."""
    return (torch.arange(batch) * num_slots).unsqueeze(1).to(device)


class Sided:
    """What every plan shares: the calls on a sequence ``(B, before + N + after, C)`` whose ``N`` image tokens (the
    plan's) have text or reference tokens ``before`` and ``after`` them, which pass as they are.

    A plan's ``merge(x, before=0, after=0)`` gives ``(B, before + M + after, C)`` and its ``unmerge(y, before=0,
    after=0)`` gives it back at ``before + N + after`` tokens; ``unmerge_update`` is whole-block ToMe's output.
    """

    kernels = "torch"  # or "triton": MergePlan's calls by merge.kernels where they can run (the planner sets it)

    def unmerge_update(self, y: torch.Tensor, merged: torch.Tensor, x: torch.Tensor, before: int = 0,
                       after: int = 0) -> torch.Tensor:
        """Whole-block ToMe's output ``x + unmerge(y - merged)`` on the image tokens, ``y`` on the others: ``y``
        ``(B, before + M + after, C)`` the block's output, ``merged`` ``(B, M, C)`` its merged image tokens, ``x``
        ``(B, before + N + after, C)`` its input."""
        if self.kernels == "triton" and triton_kernels.runs(y, merged, x):
            out = triton_kernels.unmerge_update(self, y, merged, x, before, after)
            if out is not None:
                return out
        sided = before or after
        update = (y[:, before: before + merged.shape[1]] if sided else y) - merged
        # the unmerged update first: the sum takes its (contiguous) layout, not that of a strided input (PixArt's
        # patch embedding gives its first block a transposed view), which every later block would inherit
        return join(y, self.unmerge(update) + (x[:, before: before + self.num_tokens] if sided else x), before, after)


class IdentityPlan(Sided):
    """The exact fast path: nothing is merged, inputs pass through untouched (bit for bit).

    ``num_tokens`` (and ``num_slots``, the same): the grid's token count when the matcher knows it, else None.
    """

    num_merged = 0
    batch = 1

    def __init__(self, num_tokens: int | None = None):
        self.num_tokens = self.num_slots = num_tokens

    def merge(self, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        return x

    def unmerge(self, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        return x


class MergePlan(Sided):
    """A many-to-one map from ``N`` tokens onto ``M`` merged tokens, the same for every channel.

    It is stored as one index per token (``dest``: the slot of the merged sequence a token lands in), so
    merging is a single ``index_add`` (a mean over each slot) and unmerging a single ``index_select``
    (every token reads back its slot). Both work for any trailing channel count and any float dtype. A plan made
    for batch 1 applies to every element of a batch of any size (one pattern for all, along the token axis);
    a plan made for batch ``B`` maps each element its own way.

    Args:
        dest: ``(B, N)`` int64, values in ``[0, M)``; every slot receives at least one token.
        num_slots: ``M``.
        tables: where its small index tables are kept.

    ``kernels``: ``"torch"``, or ``"triton"``: merge, unmerge and ``unmerge_update`` (with the join of the tokens
    beside the image) each one kernel of ``merge.kernels`` where it can run (the planner sets it from the config).

    Example:
        >>> plan = MergePlan(torch.tensor([[0, 0, 1, 1]]), 2)
        >>> plan.merge(torch.tensor([[[1.0], [3.0], [5.0], [7.0]]])).flatten().tolist()
        [2.0, 6.0]
    """

    def __init__(self, dest: torch.Tensor, num_slots: int, tables: Tables = TABLES):
        batch, tokens = dest.shape
        self.batch, self.num_tokens, self.num_slots = batch, tokens, num_slots
        self.num_merged = tokens - num_slots
        self.dest, self.tables = dest, tables
        device = dest.device
        # (B * N,): each token's slot in the flattened (B * M) merged tokens
        self.flat_dest = dest.reshape(-1) if batch == 1 else \
            (dest + tables.get(_starts, batch, num_slots, device)).reshape(-1)
        counts = torch.zeros(batch * num_slots, device=device, dtype=torch.float32)
        counts.index_add_(0, self.flat_dest, tables.get(_ones, batch * tokens, device))
        self._inv_counts = counts.reciprocal_().unsqueeze(1)  # (B*M, 1)
        self._inv_counts_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self._reps: torch.Tensor | None = None


    def kernel_tables(self, kind: str, before: int, after: int):
        """The index tables of the Triton kernels (``merge.kernels``) for one layout (int64, ``(P, ...)``), built on
        first use with a few kernels (none for the unmerge of a sequence of image tokens alone: the slots are its
        tables). ``kind``: ``"merge"`` (CSR: each output row's input rows, ``order``, between ``offsets[r]`` and
        ``offsets[r + 1]``) or ``"unmerge"`` (each output row's row of the merged sequence, and its slot or -1)."""
        store = self.__dict__.setdefault("_kernel_tables", {})
        key = (kind, before, after)
        found = store.get(key)
        if found is not None:
            return found
        dest, tables = self.dest, self.tables  # (P, N): each token's slot
        rows, tokens, slots, device = dest.shape[0], self.num_tokens, self.num_slots, dest.device
        if kind == "merge":
            slot_of, order = torch.sort(dest, dim=1, stable=True)  # the tokens by slot, each slot's in token order
            numbers = tables.get(arange, slots + 1, device).expand(rows, slots + 1)
            starts = torch.searchsorted(slot_of, numbers if rows == 1 else numbers.contiguous())  # (P, M + 1):
            # tokens before each slot's first; a row beside the image is a segment of its own
            found = (sided_rows(order, before, tokens, after, tables),
                     sided_rows(starts, before, tokens + 1, after, tables))
        elif before or after:
            found = (sided_rows(dest, before, slots, after, tables),
                     torch.cat([tables.get(_minus_ones, before, device).expand(rows, before), dest,
                                tables.get(_minus_ones, after, device).expand(rows, after)], 1))
        else:
            found = (dest, dest)
        store[key] = found
        return found

    def representatives(self) -> torch.Tensor:
        """``(B, M)``: for each slot, the lowest index of the tokens merged into it (its position's owner).

        ``amin`` is order-independent, so the answer is the same on every device and run.
        """
        if self._reps is not None:
            return self._reps
        dest = self.dest
        tokens = self.tables.get(arange, self.num_tokens, dest.device).expand_as(dest)
        out = torch.full((self.batch, self.num_slots), self.num_tokens, device=dest.device, dtype=dest.dtype)
        reps = out.scatter_reduce(1, dest, tokens, "amin")
        if not torch.compiler.is_compiling():
            self._reps = reps
        return reps

    def merge(self, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        """``(B, N, C) -> (B, M, C)``: each slot is the mean of the tokens that land in it; with ``before`` /
        ``after`` tokens beside the ``N`` (text), ``(B, before + N + after, C) -> (B, before + M + after, C)``."""
        if self.kernels == "triton" and triton_kernels.runs(x):
            out = triton_kernels.merge_join(self, x, before, after)
            if out is not None:
                return out
        whole, sided = x, before or after
        if sided:
            x = x[:, before: before + self.num_tokens]
        if x.dim() != 3 or (x.shape[0] != self.batch and self.batch != 1) or x.shape[1] != self.num_tokens:
            raise RuntimeError(f"token merging: merge expects a (batch={self.batch}, tokens={self.num_tokens}, "
                               f"channels) tensor, got shape {tuple(x.shape)}")
        inv = self._inv_counts_by_dtype.get(x.dtype)
        if inv is None:
            inv = self._inv_counts_by_dtype[x.dtype] = self._inv_counts.to(x.dtype)
        batch, _, channels = x.shape
        if self.batch == 1:  # one pattern for the batch: along the token axis
            out = x.new_zeros(batch, self.num_slots, channels).index_add_(1, self.flat_dest, x) * inv
        else:
            out = x.new_zeros(self.batch * self.num_slots, channels).index_add_(0, self.flat_dest,
                                                                               x.reshape(-1, channels))
            out = (out * inv).view(self.batch, self.num_slots, channels)
        return join(whole, out, before, after) if sided else out

    def unmerge(self, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        """``(B, M, C) -> (B, N, C)``: each token takes the value of its slot; with ``before`` / ``after`` tokens
        beside the ``M``, ``(B, before + M + after, C) -> (B, before + N + after, C)``."""
        if self.kernels == "triton" and triton_kernels.runs(x):
            out = triton_kernels.unmerge_join(self, x, before, after)
            if out is not None:
                return out
        whole, sided = x, before or after
        if sided:
            x = x[:, before: x.shape[1] - after]
        if x.dim() != 3 or (x.shape[0] != self.batch and self.batch != 1) or x.shape[1] != self.num_slots:
            raise RuntimeError(f"token merging: unmerge expects a (batch={self.batch}, tokens={self.num_slots}, "
                               f"channels) tensor, got shape {tuple(x.shape)}")
        if self.batch == 1:
            out = x.index_select(1, self.flat_dest)
        else:
            channels = x.shape[2]
            out = x.reshape(-1, channels).index_select(0, self.flat_dest).view(self.batch, self.num_tokens, channels)
        return join(whole, out, before, after) if sided else out


def join(whole: torch.Tensor, image: torch.Tensor, before: int, after: int, dim: int = 1) -> torch.Tensor:
    """``whole`` with its image part (along ``dim``: the tokens of ``(B, S, C)``) replaced by ``image`` (of any
    length): the rest passes untouched."""
    if not (before or after):
        return image
    parts = ([whole.narrow(dim, 0, before)] if before else []) + [image] + \
        ([whole.narrow(dim, whole.shape[dim] - after, after)] if after else [])
    return torch.cat(parts, dim)
