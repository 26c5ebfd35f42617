"""The experts' CPU kernel: all local experts of a layer in one call of our compiled
``fused_moe`` (``moe/kernels/csrc/fused_moe_cpu.cpp``) over weights packed for it.

Legend as in ``moe.fused_moe.experts``: E local experts, H = hidden_size, F = intermediate_size.
The pack is ``w [E, cols, K]`` -> ``[E, cols / 16, K, 16]`` (16 output columns per block, each
block one linear stream over K), made once from ``[w1; w3]`` (``[E, 2F, H]``) and ``w2``
(``[E, H, F]``); it needs H and 2F to be multiples of ``PACK_BLOCK``. The ``avx512_bf16`` build
multiplies bfloat16 in pairs of k (``vdpbf16ps``) and takes bfloat16 weights as
``[E, cols / 16, K / 2, 16, 2]`` (``k_group``).

Where it runs: up to a number of rows per active expert measured once per machine, dtype and
expert shape (``moe.kernels.tuning``; ``TorchExperts._measure_kernel_max_rows``), against the
path that runs otherwise.
bfloat16: the AVX2 and AVX-512 builds widen it to float32 FMAs (where oneDNN cannot multiply
bfloat16, on AVX2, the kernel wins at every size); the avx512_bf16 build multiplies bfloat16 pairs
as oneDNN does there, and AMX tiles (oneDNN on a Xeon) may still win the large GEMMs of prefill.
float32: against the grouped GEMMs (the library's SGEMM, no second copy of the weights).
Timings: docs/hardware.md, "Experts".
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


# kernel builds that multiply bfloat16 weights in pairs of k (vdpbf16ps)
K_PAIR_ISAS = frozenset({"avx512_bf16"})


def k_group(kernels: ModuleType, dtype: torch.dtype) -> int:
    """How many k the ``kernels`` build packs together for weights of ``dtype``: 2 for bfloat16
    on a build of ``K_PAIR_ISAS``, else 1."""
    return 2 if dtype == torch.bfloat16 and kernels.isa() in K_PAIR_ISAS else 1


def pack_weights(weight: Tensor, kernels: ModuleType) -> Tensor:
    """``weight`` ``[E, cols, K]`` (cols a multiple of ``PACK_BLOCK``) as the ``kernels`` build
    reads it (a copy): ``[E, cols / 16, K, 16]``, element ``[e, c // 16, k, c % 16] =
    weight[e, c, k]``; with ``k_group`` 2, ``[E, cols / 16, K / 2, 16, 2]``, element
    ``[e, c // 16, k // 2, c % 16, k % 2]`` (K even)."""
    num_experts, cols, k = weight.shape
    group = k_group(kernels, weight.dtype)
    blocks = weight.detach().reshape(num_experts, cols // PACK_BLOCK, PACK_BLOCK, k // group, group)
    packed = blocks.permute(0, 1, 3, 2, 4).contiguous()
    return packed if group == 2 else packed.squeeze(4)
