"""Dense gated MLP (the non-MoE layers and shared experts)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.layers.activation import SiluAndMul
from moe.layers.linear import Linear


class DenseMLP(nn.Module):
    """gate_proj / up_proj / down_proj SwiGLU MLP (dense layers and shared experts).

    x: [num_tokens, hidden_size] -> [num_tokens, hidden_size].
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))
