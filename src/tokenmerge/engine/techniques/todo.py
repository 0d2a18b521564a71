"""ToDo (token downsampling, arXiv 2402.13573): self-attention's keys and values come from the token grid pooled by
a factor per axis; queries stay whole (or are merged by ToMe too, ``ratio > 0``: ``MergeAround``'s merge).

Two ways, as the family declares its self-attention (``Target.keys``):

    outside the attention call (UNets, PixArt: keys and values from ``encoder_hidden_states``)
        target pre-hook   encoder_hidden_states = pool(x)          (B, N, C) -> (B, N / f^2, C)
    inside the attention call (Flux, Wan, HunyuanVideo, LTX...: rotary positions applied inside, or joint keys)
        target pre-hook   enter PoolInAttention                    every SDPA call of the target pools the image
        target            keys and values after their projections, norms and rotary embedding
        target hook       leave it (an attention backend that made no SDPA call is an error, never silent)

``PoolInAttention`` is a ``TorchFunctionMode`` that catches ``torch.nn.functional.scaled_dot_product_attention``
(what diffusers' default "native" attention backend and PyTorch's own attention use) and pools the image part of the
keys and values there; text and reference keys pass whole; a key mask is pooled the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...families.spec import JOINT, SELF
from ..call import sides
from .around import BoundTarget, MergeAround

try:
    from torch.fx.experimental.symbolic_shapes import statically_known_true as _known_true
except ImportError:  # an older torch: sizes are concrete wherever its compile reaches PoolInAttention
    def _known_true(b) -> bool:
        return bool(b)

__all__ = ["PoolKeys", "PoolInAttention", "other_function", "sdpa_arguments"]

_SDPA = F.scaled_dot_product_attention

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
NO_SDPA = ("tokenmerge: ToDo found no scaled_dot_product_attention call in {attr} to pool the keys of: its attention "
           "backend computes attention another way (ToDo pools keys inside the call only with PyTorch's SDPA, "
           "diffusers' default 'native' backend), or a cache hook on it (TaylorSeer, Pyramid Attention Broadcast) "
           "returned an output without computing it, which this ToDo cannot follow: disable one of them")


class PoolKeys(MergeAround):
    """ToDo on each patched block's self-attention (and ToMe's query merging where ``ratio > 0``)."""

    pools = True

    def __init__(self, patch):
        super().__init__(patch)
        cfg = patch.config
        self.factors, self.mode = cfg.factors(self.planner.rank), cfg.mode
        self.downsample = patch.downsampler

    def bind(self, site, spec, sub) -> BoundTarget:
        """A self-attention pooled outside its attention call (``encoder_hidden_states``) or inside it."""
        inside = spec.keys is not None and spec.kind in (SELF, JOINT)
        cfg = self.patch.config
        if not inside and spec.kind == JOINT:
            raise ValueError(f"tokenmerge: ToDo cannot pool the keys of {site.path}.{spec.attr}: joint attention "
                             f"whose key layout the {self.patch.site.family.name} family does not declare")
        if inside and (cfg.ratio > 0 or (cfg.ratio_end or 0) > 0):
            raise ValueError(f"tokenmerge: ToDo with ratio={cfg.ratio:g} on {self.patch.site.family.name}: its keys "
                             "are pooled inside the attention call from the tokens that call gets, so the queries "
                             "cannot be merged as well; use ratio=0 (or ToMe alone)")
        target = super().bind(site, spec, sub)
        if inside:
            target.inside, target.context = True, None
        elif spec.kind == SELF and target.context is None:
            raise TypeError(f"tokenmerge: {site.path}.{spec.attr} takes no encoder_hidden_states/context argument to "
                            "pass downsampled keys and values through (ToDo)")
        return target

    def target_pre(self, index: int, t: int, module, args, kwargs):
        call = self.calls.state.blocks.get(index)
        target = self.targets[index][t]
        if call is None:
            return None
        if target.inside:  # after the rotary embedding: pool inside the attention call (ratio is 0 here)
            image = call.plan.num_tokens if call.plan.num_merged else math.prod(call.grid)
            state = self.calls.state  # under Ulysses context parallelism the keys are every rank's: one segment each
            segments = 1 if state.shard is None else state.shard.split.ulysses
            call.modes[t] = mode = PoolInAttention(image, call.grid, self.factors, self.mode, target.spec.keys,
                                                   state.trailing, self.downsample, segments)
            mode.__enter__()
            return None
        if target.spec.kind == SELF and target.context.read(args, kwargs) is None:  # keys and values: the pooled grid
            if target.mask is not None and target.mask.read(args, kwargs) is not None:  # of the whole tokens
                raise ValueError(f"tokenmerge: {target.spec.attr} got an attention mask ({target.mask.name}) over "
                                 "image tokens, which ToDo cannot pool; apply the patch with merge_attn=False for "
                                 "this model")
            x = target.arg.read(args, kwargs)
            args, kwargs = target.context.replace(args, kwargs, self.downsample(x, call.grid, self.factors, self.mode))
        return super().target_pre(index, t, module, args, kwargs)  # the queries merged, where ratio > 0

    def target_post(self, index: int, t: int, module, args, output):
        call = self.calls.state.blocks.get(index)
        if call is not None and t in call.modes:
            mode = call.modes.pop(t)
            mode.__exit__(None, None, None)
            if mode.calls == 0:
                raise ValueError(NO_SDPA.format(attr=self.targets[index][t].spec.attr))
        return super().target_post(index, t, module, args, output)


class PoolInAttention(TorchFunctionMode):
    """Pools the image keys/values of every SDPA call made while it is active.

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
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not _SDPA:
            return other_function(func, args, dict(kwargs or {}))
        self.calls += 1
        kwargs = sdpa_arguments(args, kwargs)
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


def sdpa_arguments(args: tuple, kwargs: dict | None) -> dict:
    """A ``scaled_dot_product_attention`` call's arguments, all by keyword, as its signature names them."""
    return {**dict(zip(_NAMES, args)), **(kwargs or {})}


def other_function(func, args, kwargs):
    """What a mode that watches SDPA calls does with every other function: call it (``Tensor.unflatten``, written
    in Python with super(), which dynamo cannot follow from inside a mode, in its functional form: the same
    operation)."""
    if func is torch.Tensor.unflatten:
        return torch.unflatten(*args, **kwargs)
    return func(*args, **kwargs)
