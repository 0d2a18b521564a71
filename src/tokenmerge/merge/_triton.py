"""The Triton kernels of ``kernels="triton"`` (imported only when a plan runs them: ``merge.kernels``).

Both read whole rows of ``C`` channels, a program per (output row, batch element, block of channels), and accumulate
in float32 in a fixed order (deterministic: no atomics). Index arrays are ``(P, ...)`` with ``P`` 1 (one pattern for
the batch: batch stride 0) or the batch size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mean_rows(x, out, order, offsets, x_sb, x_sr, x_sc, o_sb, o_sr, i_sb, f_sb, C, BLOCK_C: tl.constexpr):
    """``out[b, r] = mean(x[b, order[b, offsets[b, r]:offsets[b, r + 1]]])``: a merged slot, or one row copied."""
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = c < C
    start = tl.load(offsets + b * f_sb + r)
    end = tl.load(offsets + b * f_sb + r + 1)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    k = start
    while k < end:  # (a while loop: Triton's interpreter cannot run a range() of loaded bounds)
        row = tl.load(order + b * i_sb + k).to(tl.int64)
        acc += tl.load(x + b * x_sb + row * x_sr + c * x_sc, mask=keep, other=0.0).to(tl.float32)
        k += 1
    acc = acc / (end - start).to(tl.float32)
    tl.store(out + b * o_sb + r.to(tl.int64) * o_sr + c, acc.to(out.dtype.element_ty), mask=keep)


@triton.jit
def gather_rows(y, x, m, out, g, h, y_sb, y_sr, y_sc, x_sb, x_sr, x_sc, m_sb, m_sr, m_sc, o_sb, o_sr, i_sb, C,
                UPDATE: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[b, r] = y[b, g[b, r]]``, plus ``x[b, r] - m[b, h[b, r]]`` where ``UPDATE`` and ``h >= 0`` (an image
    row of a whole-block merge: its input plus its slot's update)."""
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = c < C
    src = tl.load(g + b * i_sb + r).to(tl.int64)
    acc = tl.load(y + b * y_sb + src * y_sr + c * y_sc, mask=keep, other=0.0).to(tl.float32)
    if UPDATE:
        slot = tl.load(h + b * i_sb + r).to(tl.int64)
        image = keep & (slot >= 0)
        m_row = tl.load(m + b * m_sb + tl.maximum(slot, 0) * m_sr + c * m_sc, mask=image, other=0.0).to(tl.float32)
        x_row = tl.load(x + b * x_sb + r.to(tl.int64) * x_sr + c * x_sc, mask=image, other=0.0).to(tl.float32)
        acc = (acc - m_row) + x_row
    tl.store(out + b * o_sb + r.to(tl.int64) * o_sr + c, acc.to(out.dtype.element_ty), mask=keep)
