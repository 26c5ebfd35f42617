"""The experts' CPU kernel: all local experts of a layer in one call of our compiled
``fused_moe`` (``moe/kernels/csrc/fused_moe_cpu.cpp``) over weights packed for it.

Legend as in ``moe.fused_moe.experts``: E local experts, H = hidden_size, F = intermediate_size.
The pack is ``w [E, cols, K]`` -> ``[E, cols / 16, K, 16]`` (16 output columns per block, each
block one linear stream over K), made once from ``[w1; w3]`` (``[E, 2F, H]``) and ``w2``
(``[E, H, F]``); it needs H and 2F to be multiples of ``PACK_BLOCK``.

Where it runs (``kernel_runs``): float32 always (faster than the per-expert oneDNN GEMMs at every
row count measured); bfloat16 while an active expert's rows times its weights stay within
``BFLOAT16_KERNEL_MAX_MACS`` (the kernel widens bfloat16 to float32 FMAs, oneDNN multiplies
bfloat16 pairs natively: it wins the large GEMMs of prefill). Timings: docs/hardware.md, "Experts".
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from moe.kernels import cpu_kernels
from moe.platforms.custom_op import is_tracing
from moe.platforms.plugins import current_platform

PACK_BLOCK = 16  # output columns per packed block (the kernel's kBlock)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# rows per active expert x weight elements per expert (H * 3F) up to which the bfloat16 kernel is
# at least as fast as the per-expert oneDNN GEMMs (docs/hardware.md, "Experts")
BFLOAT16_KERNEL_MAX_MACS = 1 << 24


def fused_moe_kernels(
    hidden_size: int, intermediate_size: int, weight: Tensor
) -> ModuleType | None:
    """The compiled kernel module for experts of this shape with ``weight``'s dtype and device, or
    None where it does not apply: not on the CPU, a dtype other than float32 / bfloat16, H or 2F
    not a multiple of ``PACK_BLOCK``, a trace running, or no kernel build for this CPU."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in KERNEL_DTYPES
        or hidden_size % PACK_BLOCK
        or (2 * intermediate_size) % PACK_BLOCK
        or is_tracing()
    ):
        return None
    return cpu_kernels(current_platform().cpu_capability().isa)


def pack_weights(weight: Tensor) -> Tensor:
    """``weight`` ``[E, cols, K]`` (cols a multiple of ``PACK_BLOCK``) as the kernel reads it:
    ``[E, cols / 16, K, 16]``, element ``[e, c // 16, k, c % 16] = weight[e, c, k]`` (a copy)."""
    num_experts, cols, k = weight.shape
    blocks = weight.detach().reshape(num_experts, cols // PACK_BLOCK, PACK_BLOCK, k)
    return blocks.transpose(2, 3).contiguous()


def kernel_runs(dtype: torch.dtype, rows_per_expert: float, expert_elements: int) -> bool:
    """Whether the kernel serves a call of ``dtype`` whose active experts get
    ``rows_per_expert`` rows on average, each expert holding ``expert_elements`` weights
    (``3 H F``): always for float32, up to ``BFLOAT16_KERNEL_MAX_MACS`` for bfloat16."""
    return dtype == torch.float32 or rows_per_expert * expert_elements <= BFLOAT16_KERNEL_MAX_MACS
