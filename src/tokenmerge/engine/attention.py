"""Inside the attention call: modes that catch PyTorch's ``scaled_dot_product_attention`` (SDPA) while a target runs,
for the techniques that change the keys, values or queries after the model has made them (rotary positions
applied, text joined).

- ``PoolInAttention`` (ToDo, keys made inside the call): the image part of the keys and values pooled over the grid.
- ``QueryRows`` (token reuse, ``keys="fresh"``): only the recomputed tokens' query rows (and every text or reference
  row) are attended; keys and values pass whole.
- ``CachedKeys`` (token reuse, ``keys="kept"``): at a full step, a copy of every token's keys and values is kept;
  at a partial step (the block runs on the recomputed tokens) their fresh rows are written into the kept ones, in
  place, and the queries attend to all of them.

Each is an ``SdpaMode``, opened by the target's pre-hook and closed by its hook (``leave``), in one of two ways:
as a ``TorchFunctionMode`` (every function the target calls passes through it: what torch.compile traces, and what
catches an SDPA call however the model's code reached the function), or through the route (``open(route=True)``,
eager only): while any thread has a mode open this way, ``torch.nn.functional.scaled_dot_product_attention`` is
``_route``, which hands the calling thread's SDPA calls to its mode and every other thread's to the function it
replaced, so only the attention call itself reaches Python. A technique learns which way reaches a target's calls
on its first call (``Probe``: both ways at once). diffusers' default "native" attention backend and PyTorch's own
attention call SDPA; another backend makes no such call, which ``leave`` turns into an error with the reason (never a
silent no-op); ``backend_refusal`` says at apply time which backends a technique cannot reach. Under Ulysses context
parallelism the call's sequences hold ``segments`` equal parts, one per rank, each laid out as that rank's own
sequence.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..families.spec import TEXT_NONE
from ..merge.plan import TABLES, Tables, arange, sided_rows
from ..merge.recompute import extrapolated, kept_rows, row_spans, slope_of, write_rows
from .call import sides

try:
    from torch.fx.experimental.symbolic_shapes import statically_known_true as _known_true
except ImportError:  # an older torch: sizes are concrete wherever its compile reaches a mode
    def _known_true(b) -> bool:
        return bool(b)

__all__ = ["SdpaMode", "Probe", "PoolInAttention", "QueryRows", "CachedKeys", "leave", "backend_refusal",
           "SDPA_BACKENDS"]

_SDPA = F.scaled_dot_product_attention
_UNFLATTEN = torch.Tensor.unflatten
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# diffusers' attention backends (AttentionBackendName values) whose attention is PyTorch's SDPA
SDPA_BACKENDS = frozenset({"native", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math",
                           "_native_npu", "_native_xla"})


_THREAD = threading.local()  # .mode: the mode this thread opened through the route
_SWAP = threading.Lock()
_SWAPPED: list = [0, None]  # threads with a mode open through the route, the function _route replaced


def _route(*args, **kwargs):
    """``torch.nn.functional.scaled_dot_product_attention`` while a mode is open through the route: this thread's
    mode attends, other threads' calls go to the function it replaced."""
    mode = getattr(_THREAD, "mode", None)
    if mode is None:
        return _SWAPPED[1](*args, **kwargs)
    mode.routed += 1
    return mode.attend(_SWAPPED[1], {**dict(zip(_NAMES, args)), **kwargs})


class SdpaMode(TorchFunctionMode):
    """A mode whose ``attend(func, kwargs)`` runs each SDPA call (its arguments by keyword); every other function
    runs as it is (``Tensor.unflatten``, written in Python with super(), which dynamo cannot follow from inside a mode,
    in its functional form). ``calls``: the SDPA calls ``attend`` acted on; ``routed``: the calls that came through
    the route."""

    calls = 0
    routed = 0
    _way = None  # how it is open: "route", "mode" or None (closed)
    _previous = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not _SDPA:
            if func is _UNFLATTEN:
                return torch.unflatten(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
        return self.attend(func, {**dict(zip(_NAMES, args)), **(kwargs or {})})

    def open(self, route: bool = False) -> "SdpaMode":
        """Catch this thread's SDPA calls until ``close``: through the route where ``route`` (and not under
        torch.compile), else as a ``TorchFunctionMode``."""
        if route and not torch.compiler.is_compiling():
            self._way, self._previous = "route", getattr(_THREAD, "mode", None)
            _THREAD.mode = self
            with _SWAP:
                if _SWAPPED[0] == 0:
                    _SWAPPED[1] = F.scaled_dot_product_attention
                    F.scaled_dot_product_attention = _route
                _SWAPPED[0] += 1
        else:
            self._way = "mode"
            self.__enter__()
        return self

    def close(self) -> None:
        """Stop catching (a no-op when closed already)."""
        way, self._way = self._way, None
        if way == "mode":
            self.__exit__(None, None, None)
        elif way == "route":
            _THREAD.mode = self._previous
            with _SWAP:
                _SWAPPED[0] -= 1
                if _SWAPPED[0] == 0:
                    if F.scaled_dot_product_attention is _route:  # (else replaced since: left as it is)
                        F.scaled_dot_product_attention = _SWAPPED[1]
                    _SWAPPED[1] = None


class Probe(SdpaMode):
    """Counts a target's SDPA calls, open both ways at once (``open_both``): ``calls`` > 0 where the attention
    calls SDPA at all, ``routed`` > 0 where the route reaches those calls."""

    def attend(self, func, kwargs: dict):
        self.calls += 1
        return func(**kwargs)

    def open_both(self) -> "Probe":
        """Open as a mode and through the route (eager only: the route's call of SDPA reaches the mode too)."""
        self.__enter__()
        self.open(route=True)
        return self

    def close(self) -> None:
        if self._way == "route":
            super().close()
            self.__exit__(None, None, None)


def leave(mode: SdpaMode, message: str) -> None:
    """Close ``mode``; raise ``ValueError(message)`` if it caught no SDPA call (the backend computes attention
    another way)."""
    mode.close()
    if mode.calls == 0:
        raise ValueError(message)


def backend_refusal(module: torch.nn.Module, what: str) -> str | None:
    """Why ``what`` (a technique that works inside SDPA) cannot run on the attention ``module`` with the diffusers
    attention backend set on it (``set_attention_backend``), or ``None``."""
    processor = getattr(module, "processor", None)
    backend = getattr(processor, "_attention_backend", None)
    name = getattr(backend, "value", backend)
    if name is None or str(name) in SDPA_BACKENDS:
        return None
    return (f"{what} works inside PyTorch's scaled_dot_product_attention, and the attention backend {str(name)!r} "
            "set on it (set_attention_backend) computes attention another way; use the 'native' backend (or one of "
            "the '_native_*' ones) for this model, or ToMe (apply_patch), which merges outside the attention call")


class PoolInAttention(SdpaMode):
    """Pools the image keys/values of every SDPA call made while it is active (ToDo).

    Args:
        image: image tokens in the key sequence; grid: their grid; factors, mode: ToDo's pooling.
        keys: where text sits in the key sequence (``TEXT_BEFORE`` / ``TEXT_AFTER`` / ``TEXT_NONE``).
        trailing: reference tokens after the image's; downsample: the pooling function (the bench may replace it).
        segments: under Ulysses context parallelism (``engine/parallel.py``), the keys hold every rank's tokens, one
            equal segment per rank laid out as the rank's own sequence: each segment is pooled over the rank's grid.
    """

    def __init__(self, image: int, grid, factors, mode: str, keys: str, trailing: int, downsample,
                 segments: int = 1):
        super().__init__()
        self.image, self.grid, self.factors, self.mode = image, grid, factors, mode
        self.keys, self.trailing, self.downsample = keys, trailing, downsample
        self.segments = segments

    def attend(self, func, kwargs: dict):
        self.calls += 1
        key = kwargs["key"]
        before, after = sides(key.shape[-2] // self.segments, self.image, self.keys, self.trailing)
        kwargs["key"] = self._each(self._pool, key, -2, before, after)
        kwargs["value"] = self._each(self._pool, kwargs["value"], -2, before, after)
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.shape[-1] > 1:
            kwargs["attn_mask"] = self._each(self._pool_mask, mask, -1, before, after)
        return func(**kwargs)

    def _each(self, pool, x: torch.Tensor, axis: int, before: int, after: int) -> torch.Tensor:
        """``pool`` of each of the ``segments`` equal parts of ``x`` along ``axis`` (one part: ``pool(x)``)."""
        if self.segments == 1:
            return pool(x, before, after)
        if x.shape[axis] % self.segments:
            raise ValueError(f"tokenmerge: under context parallelism an attention call got {x.shape[axis]} keys, "
                             f"which are not {self.segments} equal segments (one per rank)")
        return torch.cat([pool(part, before, after) for part in x.chunk(self.segments, axis)], axis)

    def _pool(self, x: torch.Tensor, before: int, after: int) -> torch.Tensor:
        """``(..., S, D)`` with its image rows pooled over the grid."""
        lead, n, d = x.shape[:-2], self.image, x.shape[-1]
        image = x.narrow(-2, before, n).reshape(-1, n, d)
        pooled = self.downsample(image, self.grid, self.factors, self.mode)
        pooled = pooled.reshape(*lead, pooled.shape[1], d)
        parts = ([x.narrow(-2, 0, before)] if _some(before) else []) + [pooled] + \
            ([x.narrow(-2, x.shape[-2] - after, after)] if _some(after) else [])
        # contiguous: the pooling's output is a transposed view, and SDPA on keys whose last axis is strided
        # leaves its fused kernels for the unfused math path (measured: 3-D pooling of Wan's keys cost more in
        # attention than it saved)
        return torch.cat(parts, -2) if len(parts) > 1 else pooled.contiguous()

    def _pool_mask(self, mask: torch.Tensor, before: int, after: int) -> torch.Tensor:
        """A key mask pooled like the keys: a boolean one keeps a pooled key if any token it pools is allowed
        (exactly that token's entry for nearest pooling); an additive one only with nearest pooling (exact)."""
        if mask.dtype != torch.bool and self.mode != "nearest-exact":
            raise ValueError("tokenmerge: ToDo with an additive attention mask pools keys only with "
                             "mode='nearest-exact'; use apply_todo(..., mode='nearest-exact') for this model")
        n = self.image
        image = mask.narrow(-1, before, n)
        lead = image.shape[:-1]
        flat = image.reshape(-1, n, 1)
        if mask.dtype == torch.bool:
            pooled = self.downsample(flat.float(), self.grid, self.factors, self.mode) > 0
        else:
            pooled = self.downsample(flat, self.grid, self.factors, self.mode)
        pooled = pooled.reshape(*lead, pooled.shape[1])
        parts = ([mask.narrow(-1, 0, before)] if _some(before) else []) + [pooled] + \
            ([mask.narrow(-1, mask.shape[-1] - after, after)] if _some(after) else [])
        return torch.cat(parts, -1) if len(parts) > 1 else pooled


def _some(n) -> bool:
    """Whether a part of ``n`` tokens may be non-empty: a number of tokens that is only known at run time (a
    symbolic size under torch.compile, e.g. Mochi's valid prompt tokens) is kept, as a part of possibly none."""
    return not _known_true(n == 0)


@dataclasses.dataclass(eq=False)
class QueryRows(SdpaMode):
    """Token reuse, ``keys="fresh"``: each SDPA call over the image's queries keeps only the query rows of the
    recomputed image tokens (and every text or reference row); keys and values pass whole. A mask with a row per
    query keeps the same rows. Under Ulysses (``segments`` > 1) the output comes back at every query row (zeros at
    the others), as the all-to-all after the call needs.

    Args:
        image: image tokens in the sequence; index: ``(|S|,)`` the recomputed ones, sorted;
        keys: where text sits in the attention call's sequence (``Target.keys``); trailing: reference tokens.
    """

    image: int
    index: torch.Tensor
    keys: str | None
    trailing: int
    segments: int = 1
    tables: Tables = TABLES

    def attend(self, func, kwargs: dict):
        query = kwargs["query"]  # (B, H, L, D)
        length = query.shape[-2] // self.segments
        if length < self.image:  # not a call over the image's queries (e.g. a second attention over other tokens)
            return func(**kwargs)
        self.calls += 1
        before, after = sides(length, self.image, self.keys or TEXT_NONE, self.trailing)
        rows = sided_rows(self.index, before, self.image, after, self.tables)
        if self.segments > 1:  # the same rows of each rank's segment
            rows = (self.tables.get(arange, self.segments, rows.device)[:, None] * length + rows).flatten()
        kwargs["query"] = query.index_select(-2, rows)
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[-2] == query.shape[-2] > 1:
            kwargs["attn_mask"] = mask.index_select(-2, rows)
        out = func(**kwargs)
        if self.segments == 1:
            return out
        return out.new_zeros(query.shape[:-1] + out.shape[-1:]).index_copy_(-2, rows, out)


KEYS_AHEAD = 0.5  # extrapolate: kept keys and values move this share as far as the kept residuals (seeds 0-1 of
# the mosaic testbed: 0.5 was 2.2 dB more faithful than 1 or 0; benchmarks/results/quality)


@dataclasses.dataclass(eq=False)
class CachedKeys(SdpaMode):
    """Token reuse, ``keys="kept"``: each SDPA call over the image's keys keeps (at a full step, ``index`` None) a
    copy of its keys and values in ``pairs``, or (at a partial step: the block runs on the ``index`` tokens alone)
    writes their fresh rows (and the text's) into the kept ones, in place, and attends to all of them. An attention
    that calls SDPA once per sample (Mochi: each prompt's valid text) keeps one pair per call.

    Args: as ``QueryRows``; pairs: a list holding this attention's kept ``[keys, values]`` (B, H, L, D) per SDPA
    call, every row of the call's sequence (text, image and reference rows), and with ``spans`` their slopes after
    them; text: ``text=True``: the recomputed text tokens (sorted indices; ``None``: every text row is fresh);
    spans: ``extrapolate=``: ``merge.recompute.since``'s spans of the image tokens and of the text's (or ``None``),
    and the call's store where the rows' spans are kept for its other attentions: the kept rows attended move along
    their slopes.
    """

    image: int
    index: torch.Tensor | None
    keys: str | None
    trailing: int
    pairs: list
    text: torch.Tensor | None = None
    segments: int = 1
    tables: Tables = TABLES
    spans: tuple | None = None

    def attend(self, func, kwargs: dict):
        key = kwargs["key"]
        count = self.image if self.index is None else self.index.shape[0]
        length = key.shape[-2] // self.segments
        if length < count or (self.index is not None and self.calls >= len(self.pairs)):  # not the call over the
            return func(**kwargs)  # image's keys, or one more than the full step made: untouched
        before, after = sides(length, count, self.keys or TEXT_NONE, self.trailing)
        pair = self.calls
        self.calls += 1
        if self.index is None:
            kept = [key.contiguous().clone(), kwargs["value"].contiguous().clone()]
            old = self.pairs[pair] if pair < len(self.pairs) else None
            if self.spans is not None and old is not None and old[0].shape == key.shape:  # extrapolate: the slopes
                at = self._row_spans(before, before, after)[0]
                kept += [slope_of(new, was, at) for new, was in zip(kept, old)]
            del self.pairs[pair:]
            self.pairs.append(kept)
            return func(**kwargs)
        kept = self.pairs[pair][0]
        kept_length = kept.shape[-2] // self.segments
        kept_before = before if self.text is None else kept_length - self.image - after
        fits = kept.shape[:-2] == key.shape[:-2] and kept_length == kept_before + self.image + after and (
            self.text is None or self.text.shape[0] == before)
        if not fits:  # the text changed length since the keys were kept: every text row fresh
            if self.segments > 1:
                raise ValueError("tokenmerge: token reuse with keys='kept' under context parallelism got a call "
                                 "whose text changed length since its keys were kept")
            kwargs["key"], kwargs["value"] = (_rebuilt(k, fresh, before, self.image, after, self.index)
                                              for k, fresh in zip(self.pairs[pair], (key, kwargs["value"])))
            return func(**kwargs)
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[-1] > 1:
            kwargs["attn_mask"] = self._mask(mask, before, count, after)
        rows = kept_rows(self.index, self.text, kept_before, self.image, after, before, self.segments, self.tables)
        kept = self.pairs[pair]
        if self.spans is not None and len(kept) == 2:  # extrapolate: no change measured yet (held until one is)
            kept += [torch.zeros_like(kept[0]), torch.zeros_like(kept[1])]
        if self.spans is not None:  # extrapolate: the fresh rows' slopes, the kept rows moved along theirs
            at, ahead = self._row_spans(before, kept_before, after)
            for was, slope, fresh in zip(kept, kept[2:], (key, kwargs["value"])):
                write_rows(was, slope, fresh, rows, at)
            kwargs["key"], kwargs["value"] = (extrapolated(was, slope, ahead) for was, slope in zip(kept, kept[2:]))
            return func(**kwargs)
        for was, fresh in zip(kept, (key, kwargs["value"])):
            was.index_copy_(-2, rows, fresh)
        kwargs["key"], kwargs["value"] = kept[:2]
        return func(**kwargs)

    def _row_spans(self, fresh_before: int, before: int, after: int) -> tuple:
        """``merge.recompute.row_spans`` of this call's key sequences laid out so, ``ahead`` times ``KEYS_AHEAD``:
        made once per call and layout, kept in the call's store for every block's attention (afresh under
        torch.compile, which fuses it)."""
        image, text, store = self.spans
        key = ("rows", id(image[0]), None if text is None else id(text[0]), fresh_before, before, after)
        found = None if torch.compiler.is_compiling() else store.get(key)
        if found is None:
            at, ahead = row_spans(image, text, fresh_before, before, after, self.segments)
            found = (at, None if ahead is None else ahead * KEYS_AHEAD)
            if not torch.compiler.is_compiling():
                store[key] = found
        return found

    def _mask(self, mask: torch.Tensor, before: int, count: int, after: int) -> torch.Tensor:
        """A mask made by the model for this call: its key columns extended to every kept token (a mask made over
        the recomputed tokens only, e.g. Qwen-Image's, whose image columns are all alike: each kept image token takes
        that value), its rows (one per query, where it has them) at the recomputed tokens."""
        total = before + self.image + after
        if self.segments == 1 and mask.shape[-1] == before + count + after != total:
            image = mask.narrow(-1, before, count)
            if not bool((image == image.narrow(-1, 0, 1)).all()):
                raise ValueError("tokenmerge: token reuse with keys='kept' got an attention mask over the keys of "
                                 "the recomputed tokens only, which differs between them, so it cannot be extended to "
                                 "the kept ones; use keys='fresh'")
            shape = image.shape[:-1] + (self.image,)
            mask = torch.cat([mask.narrow(-1, 0, before), image.narrow(-1, 0, 1).expand(shape),
                              mask.narrow(-1, before + count, after)], -1)
        elif mask.shape[-1] != total * self.segments:
            raise ValueError("tokenmerge: token reuse with keys='kept' got an attention mask over keys it cannot "
                             "follow; use keys='fresh'")
        if mask.shape[-2] == total:
            mask = mask.index_select(-2, sided_rows(self.index, before, self.image, after, self.tables))
        return mask


def _rebuilt(kept: torch.Tensor, fresh: torch.Tensor, before: int, image: int, after: int,
             index: torch.Tensor) -> torch.Tensor:
    """Kept keys (or values) whose text changed length: its image rows (fresh at ``index``), every text and
    reference row fresh."""
    axis = fresh.dim() - 2
    image_rows = kept.narrow(axis, kept.shape[axis] - image - after, image).index_copy(
        axis, index, fresh.narrow(axis, before, index.shape[0]))
    parts = [fresh.narrow(axis, 0, before), image_rows, fresh.narrow(axis, fresh.shape[axis] - after, after)]
    return torch.cat(parts, axis)
