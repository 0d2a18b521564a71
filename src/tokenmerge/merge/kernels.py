"""``kernels="triton"``: a merge plan's merge, unmerge and whole-block update, each with the join of the text or
reference tokens beside the image, in one Triton kernel instead of 1 to 4 torch kernels each.

The torch path (``MergePlan.merge`` / ``unmerge``, ``call.join``) stays the reference and runs wherever these cannot:
under ``torch.compile`` (inductor fuses the torch ops itself), on devices other than CUDA, for dtypes other than
float16 / bfloat16 / float32. With ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (Triton's
interpreter: how the parity tests run without a GPU).

What each does, for a sequence of ``(B, S, C)`` with ``before`` tokens ahead of the ``N`` image tokens and ``after``
behind them (``M`` merged slots):

- ``merge_join``: ``(B, S, C) -> (B, before + M + after, C)``, each slot the mean of its tokens (float32 sums in a
  fixed order: deterministic, where ``index_add`` on CUDA adds in any order), the other tokens copied;
- ``unmerge_join``: ``(B, before + M + after, C) -> (B, S, C)``, each image token its slot's value;
- ``unmerge_update`` (whole-block ToMe): ``x + unmerge(y - m)`` on the image tokens, ``y`` elsewhere.

The index tables (a slot's tokens in order; each output row's source row) are built once per plan and layout with
a few torch kernels and kept on the plan.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

__all__ = ["KERNELS", "missing", "failed", "runs", "merge_join", "unmerge_join", "unmerge_update"]

KERNELS = ("torch", "triton")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK = 1024  # channels per program


def missing() -> str | None:
    """Why ``kernels="triton"`` cannot run here (the package is not installed), or None."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (it comes with PyTorch's CUDA builds on Linux)"
    return None


_failed: str | None = None  # why a kernel failed to build or launch in this process: the torch operators run since


def failed() -> str | None:
    """Why the Triton kernels stopped running in this process (a kernel that failed to build or launch; the merges
    went on with the torch operators, after one warning), or None."""
    return _failed


def runs(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take a call on ``tensors``: eager, one float dtype of ``_DTYPES``, all on CUDA
    (or on the CPU under ``TRITON_INTERPRET=1``), none failed before in this process."""
    if torch.compiler.is_compiling() or _failed is not None:
        return False
    first = tensors[0]
    if first.dtype not in _DTYPES or first.dim() != 3:
        return False
    device = first.device
    if not (device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        return False
    return all(t.device == device and t.dtype == first.dtype and t.dim() == 3 for t in tensors[1:])


def _launch(name: str, out: torch.Tensor, *args, **meta) -> torch.Tensor | None:
    """Run kernel ``name`` of ``_triton`` over the rows of ``out`` ``(B, R, C)`` (``args``, then ``C``): ``out``, or
    None (after one warning, and for the rest of the process) when it could not be built or launched, so that the
    caller runs the torch operators: a generation never fails halfway."""
    global _failed
    batch, rows, channels = out.shape
    block = _block(channels)
    try:
        from . import _triton

        getattr(_triton, name)[(rows, batch, -(-channels // block))](*args, channels, BLOCK_C=block,
                                                                      num_warps=_warps(block), **meta)
        return out
    except Exception as err:  # an old GPU, a triton that does not match torch, a compiler error
        _failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
        warnings.warn(f"tokenmerge: the Triton kernels (kernels='triton') failed ({_failed}); merging goes on with "
                      "the torch operators", RuntimeWarning, stacklevel=4)
        return None


def _output(x: torch.Tensor, tokens: int, rows: int, what: str) -> torch.Tensor:
    """``(B, rows, C)``, empty, for ``x`` ``(B, tokens, C)``."""
    if x.shape[1] != tokens:
        raise RuntimeError(f"token merging: {what} expects {tokens} tokens, got shape {tuple(x.shape)}")
    return x.new_empty(x.shape[0], rows, x.shape[2])


def _block(channels: int) -> int:
    """Channels per program: the power of two that covers a row with the fewest masked lanes (256 to 1024; a
    narrower row takes one program of its width rounded up)."""
    if channels <= 256:
        return 1 << max(channels - 1, 0).bit_length()
    return min((256, 512, _MAX_BLOCK), key=lambda b: (-(-channels // b) * b - channels, -b))


def _warps(block: int) -> int:
    return max(1, min(4, block // 256))  # 8 elements per thread (16-byte loads in half precision)


def _batch_stride(plan, batch: int, table: torch.Tensor) -> int:
    if plan.batch == 1:
        return 0
    if plan.batch != batch:
        raise RuntimeError(f"token merging: a plan made for batch {plan.batch} got a batch of {batch}")
    return table.stride(0)


def merge_join(plan, x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor | None:
    """``(B, before + N + after, C) -> (B, before + M + after, C)``: the image tokens merged, the rest copied (None:
    the kernel failed, the caller runs the torch operators; so do the others)."""
    out = _output(x, before + plan.num_tokens + after, before + plan.num_slots + after, "merge")
    order, offsets = plan.kernel_tables("merge", before, after)
    return _launch("mean_rows", out, x, out, order, offsets, *x.stride(), out.stride(0), out.stride(1),
                   _batch_stride(plan, x.shape[0], order), _batch_stride(plan, x.shape[0], offsets))


def _gather(plan, y: torch.Tensor, x: torch.Tensor | None, m: torch.Tensor | None, before: int, after: int):
    out = _output(y, before + plan.num_slots + after, before + plan.num_tokens + after, "unmerge")
    g, h = plan.kernel_tables("unmerge", before, after)
    update = x is not None
    xs = x.stride() if update else (0, 0, 0)
    ms = m.stride() if update else (0, 0, 0)
    return _launch("gather_rows", out, y, x if update else y, m if update else y, out, g, h, *y.stride(), *xs, *ms,
                   out.stride(0), out.stride(1), _batch_stride(plan, y.shape[0], g), UPDATE=update)


def unmerge_join(plan, y: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor | None:
    """``(B, before + M + after, C) -> (B, before + N + after, C)``: each image token its slot's value."""
    return _gather(plan, y, None, None, before, after)


def unmerge_update(plan, y: torch.Tensor, merged: torch.Tensor, x: torch.Tensor, before: int = 0,
                   after: int = 0) -> torch.Tensor | None:
    """Whole-block ToMe's output: ``x + unmerge(y - merged)`` on the image tokens, ``y`` on the others.

    ``y`` ``(B, before + M + after, C)``: the block's output; ``merged`` ``(B, M, C)``: its merged input's image
    tokens; ``x`` ``(B, before + N + after, C)``: its input (only the image rows are read)."""
    if merged.shape[1] != plan.num_slots or x.shape[1] != before + plan.num_tokens + after:
        raise RuntimeError(f"token merging: the whole-block update expects {plan.num_slots} merged and "
                           f"{before} + {plan.num_tokens} + {after} input tokens, got {tuple(merged.shape)} and "
                           f"{tuple(x.shape)}")
    return _gather(plan, y, x, merged, before, after)
