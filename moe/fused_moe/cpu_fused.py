"""The experts' CPU kernel: all local experts of a layer in one call of our compiled
``fused_moe`` (``moe/kernels/csrc/fused_moe_cpu.cpp``) over weights packed for it.

Legend as in ``moe.fused_moe.experts``: E local experts, H = hidden_size, F = intermediate_size.
The pack is ``w [E, cols, K]`` -> ``[E, cols / 16, K, 16]`` (16 output columns per block, each
block one linear stream over K), made once from ``[w1; w3]`` (``[E, 2F, H]``) and ``w2``
(``[E, H, F]``); it needs H and 2F to be multiples of ``PACK_BLOCK``.

Where it runs: up to a number of rows per active expert measured once per machine, dtype and
expert shape (``kernel_max_rows``; ``moe.kernels.tuning``), against the path that runs otherwise.
bfloat16: the kernel widens it to float32 FMAs, so where oneDNN multiplies bfloat16 pairs natively
(avx512_bf16, AMX) it wins the large GEMMs of prefill, and where it cannot (AVX2) the kernel wins
at every size. float32: against the grouped GEMMs (the library's SGEMM, no second copy of the
weights). Timings: docs/hardware.md, "Experts".
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from moe.kernels import cpu_kernels
from moe.kernels.tuning import measure_max_rows, tuned_max_rows
from moe.platforms.custom_op import is_tracing
from moe.platforms.plugins import current_platform

PACK_BLOCK = 16  # output columns per packed block (the kernel's kBlock)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# the measurement's largest call (rows x 3HF multiply-adds: ~10 ms on one core)
MEASURE_MAX_MACS = 1 << 28


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


def kernel_max_rows(kernels: ModuleType, experts: str, measure: Callable[[], float]) -> float:
    """The rows per active expert up to which the kernel serves ``experts`` (dtype and shape,
    e.g. ``"torch.bfloat16 H=2048 F=1408"``): ``measure()`` once per machine
    (``moe.kernels.tuning.tuned_max_rows``)."""
    return tuned_max_rows(kernels, f"experts {experts}", measure)


def measure_kernel_max_rows(seconds: Callable[[bool, int], float], expert_elements: int) -> float:
    """``measure_max_rows`` for experts of ``expert_elements`` weights each (3 H F): one
    expert's rows, up to ``MEASURE_MAX_MACS`` multiply-adds a call."""
    return measure_max_rows(seconds, MEASURE_MAX_MACS // expert_elements)
