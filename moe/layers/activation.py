"""SwiGLU activation (Shazeer 2020): silu(gate) * up, as a custom op."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from moe.platforms.custom_op import CustomOp


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """SwiGLU activation: silu(gate) * up, gate/up [..., F] -> [..., F] (``hidden_act="silu"``)."""

    def forward_native(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU activation: silu(gate) * up (plain function, the reference of ``SiluAndMul``)."""
    return F.silu(gate) * up
