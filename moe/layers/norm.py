"""RMSNorm (Zhang & Sennrich 2019) as a custom op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.platforms.custom_op import CustomOp, is_graph_tracing, is_tracing

# Rows whose float32 working copy fits this many bytes go through one F.rms_norm call: torch's CPU
# F.rms_norm is composite (a float32 copy, square, mean, rsqrt, scale: ~5 passes over the rows),
# so on a tall batch every pass streams from memory, and blocks of rows that stay in the L2 cache
# run faster (docs/hardware.md, "Other ops"). Rows are independent, so the result is bit-identical.
RMS_NORM_BLOCK_BYTES = 256 * 1024


def rows_per_cache_block(hidden_size: int) -> int:
    """Rows per ``RMSNorm.forward_cpu`` call: a float32 working copy of ``RMS_NORM_BLOCK_BYTES``
    (at least 1 row)."""
    return max(1, RMS_NORM_BLOCK_BYTES // (4 * max(hidden_size, 1)))


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32.

    x: [..., hidden_size], any float dtype; the result has x's dtype (times weight's dtype).
    ``forward_cpu``: float32 runs torch's fused ``F.rms_norm``; bfloat16 runs ``F.rms_norm``
    without weight (float32 statistics and scaling, one rounding, as the reference's
    ``(x32 * rsqrt(...)).to(bfloat16)``), then the weight's multiply (at most one bf16 rounding of
    the normalised value from the reference: float32 summation order); float64 (statistics in
    float32, as transformers) the reference. More than ``rows_per_cache_block(hidden_size)`` rows
    run in blocks of that many (results unchanged). Why, and the timings: docs/hardware.md,
    "Other ops".
    ``forward_cuda``: float32, float16 and bfloat16 in one Triton launch
    (``moe.layers.triton_norm``) where Triton launches; ``forward_native`` for float64, where
    Triton cannot launch, and while a graph is traced (the tracer cannot see into a launch).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward_cpu(self, x: Tensor) -> Tensor:
        fused = x.dtype == torch.float32 and self.weight.dtype == torch.float32
        if not fused and x.dtype != torch.bfloat16:
            return self.forward_native(x)
        num_rows = x.numel() // max(x.shape[-1], 1)
        chunk = rows_per_cache_block(x.shape[-1])
        if num_rows <= chunk or is_tracing():  # a compiled graph fuses the passes itself
            return self._normalize(x, fused)
        x2d = x.reshape(num_rows, x.shape[-1])
        out = torch.empty_like(x2d, dtype=torch.promote_types(x.dtype, self.weight.dtype))
        for start in range(0, num_rows, chunk):
            out[start : start + chunk] = self._normalize(x2d[start : start + chunk], fused)
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward_cuda(self, x: Tensor) -> Tensor:
        from moe.layers import triton_norm  # Triton itself only when a kernel launches

        if is_graph_tracing() or not triton_norm.can_launch_rms_norm(x, self.weight):
            return self.forward_native(x)
        return triton_norm.triton_rms_norm(x, self.weight, self.eps)

    def _normalize(self, x: Tensor, fused: bool) -> Tensor:
        if fused:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)

    def forward_native(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)
