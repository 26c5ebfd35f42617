"""RMSNorm (Zhang & Sennrich 2019) as a custom op."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.platforms.custom_op import CustomOp


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32.

    x: [..., hidden_size], any float dtype; the result has x's dtype (times weight's dtype).
    No forward_cpu: torch's fused ``F.rms_norm`` measured no faster on CPU (and rounds differently
    in bfloat16), so every platform uses the reference.
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

    def forward_native(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)
