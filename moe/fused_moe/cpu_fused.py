"""The experts' CPU kernel: all local experts of a layer in one call of our compiled
``fused_moe`` (``moe/kernels/csrc/fused_moe_cpu.cpp``) over weights packed for it.

Legend as in ``moe.fused_moe.experts``: E local experts, H = hidden_size, F = intermediate_size.
The pack is ``w [E, cols, K]`` -> ``[E, cols / 16, K, 16]`` (16 output columns per block, each
block one linear stream over K), made once from ``[w1; w3]`` (``[E, 2F, H]``) and ``w2``
(``[E, H, F]``); it needs H and 2F to be multiples of ``PACK_BLOCK``.

Where it runs: up to a number of rows per active expert measured once per machine, dtype and
expert shape (``moe.kernels.tuning``; ``TorchExperts._measure_kernel_max_rows``), against the
path that runs otherwise.
bfloat16: the kernel widens it to float32 FMAs, so where oneDNN multiplies bfloat16 pairs natively
(avx512_bf16, AMX) it wins the large GEMMs of prefill, and where it cannot (AVX2) the kernel wins
at every size. float32: against the grouped GEMMs (the library's SGEMM, no second copy of the
weights). Timings: docs/hardware.md, "Experts".
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
