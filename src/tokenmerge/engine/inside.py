"""ToDo inside the attention call: keys and values pooled after the rotary embedding.

Where a model applies rotary positions to its keys inside the attention call (Wan, LTX, Flux, HunyuanVideo...),
or makes keys of image and text tokens in one call (joint attention), pooled tokens cannot be passed in as
``encoder_hidden_states``. Instead, while the target sub-module runs, a ``TorchFunctionMode`` catches its calls to
``torch.nn.functional.scaled_dot_product_attention`` (what diffusers' default "native" attention backend and
PyTorch's own attention use) and pools the image part of the keys and values there, over the token grid, after
every projection, norm and rotary embedding; queries stay whole. Text and reference keys pass whole; a key mask
is pooled the same way. An attention backend that does not go through SDPA (flash-attn, sage, xformers, flex)
would leave the keys unpooled: that is detected after the call and raised, never passed silently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .layout import sides

__all__ = ["PoolKeys"]

_SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class PoolKeys(TorchFunctionMode):
    """Pools the image keys/values of every SDPA call made while it is active.

    Args:
        image: image tokens in the key sequence; grid: their grid; factors, mode: ToDo's pooling.
        keys: where text sits in the key sequence (``TEXT_BEFORE`` / ``TEXT_AFTER`` / ``TEXT_NONE``).
        trailing: reference tokens after the image's; downsample: the pooling function (the bench may replace it).
        segments: under Ulysses context parallelism (parallel.py), the keys hold every rank's tokens, one equal
            segment per rank laid out as the rank's own sequence: each segment is pooled over the rank's grid.
    """

    def __init__(self, image: int, grid, factors, mode: str, keys: str, trailing: int, downsample, segments: int = 1):
        self.image, self.grid, self.factors, self.mode = image, grid, factors, mode
        self.keys, self.trailing, self.downsample = keys, trailing, downsample
        self.segments = segments
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not _SDPA:
            return func(*args, **kwargs)
        self.calls += 1
        for i, name in enumerate(_NAMES[: len(args)]):  # everything by keyword, as SDPA's signature names it
            kwargs[name] = args[i]
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
        parts = ([x.narrow(-2, 0, before)] if before else []) + [pooled] + \
            ([x.narrow(-2, x.shape[-2] - after, after)] if after else [])
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
        parts = ([mask.narrow(-1, 0, before)] if before else []) + [pooled] + \
            ([mask.narrow(-1, mask.shape[-1] - after, after)] if after else [])
        return torch.cat(parts, -1) if len(parts) > 1 else pooled
