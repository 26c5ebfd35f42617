"""The Triton kernel of ``RMSNorm.forward_cuda`` (``moe.layers.triton_norm``). Imports Triton:
import this module only where a kernel runs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [num_rows, hidden_size], row stride x_row_stride, unit stride along the row
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_rows, hidden_size], contiguous, promote(x.dtype, weight.dtype)
    x_row_stride,
    hidden_size,
    eps,
    BLOCK_N: tl.constexpr,  # next power of 2 >= hidden_size
):
    """One program per row, ``RMSNorm.forward_native``'s arithmetic: the statistics in float32,
    the normalised row rounded to x's dtype, times the weight in float32 rounded to the output
    dtype (float32, float16, bfloat16: a product of two 16-bit floats is exact in float32, so one
    rounding, as torch's)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
