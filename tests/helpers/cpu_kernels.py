"""Run the compiled CPU kernels for one ISA in a test, or skip with the reason.

Every ISA in ``moe.kernels.ISA_FLAGS`` whose build this CPU runs is tested: up to
the platform's ISA (torch's capability probe, capped by ``ATEN_CPU_CAPABILITY`` and
``MOE_DBO_CPU_ISA``), so an AVX-512 machine tests the AVX2 build too and a capped run only the
ISAs under the cap. Each ISA's build is its own extension module, so both load in one process.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from moe import kernels
from moe.platforms import current_platform

ISAS = tuple(kernels.ISA_FLAGS)  # ("avx2", "avx512", "avx512_bf16"), lowest first

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler on this machine: the CPU kernels cannot be built here",
)


def runnable_isas() -> tuple[str, ...]:
    """The ISAs of ``ISAS`` this CPU runs (under the caps), lowest first."""
    best = current_platform().cpu_capability().isa
    return ISAS[: ISAS.index(best) + 1] if best in ISAS else ()


def kernel_module_for(isa: str):
    """The kernel module built for ``isa``; skips if there is no C++ compiler or if this CPU (or a
    cap) rules ``isa`` out, fails if it does not build on a machine with a compiler."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built here")
    if isa not in runnable_isas():
        pytest.skip(
            f"no {isa} build here: the platform's ISA is "
            f"{current_platform().cpu_capability().isa} (torch's CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, the CPU's avx512_bf16 flag and the caps "
            f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')!r}, "
            f"MOE_DBO_CPU_ISA={os.environ.get('MOE_DBO_CPU_ISA', '')!r})"
        )
    module = kernels.cpu_kernels(isa)
    if module is None:
        pytest.fail(f"the CPU kernels ({isa}) did not build on a machine with a C++ compiler")
    return module
