"""The experts' CPU kernel: all local experts of a layer in one call of our compiled
``fused_moe`` (``moe/kernels/csrc/fused_moe_cpu.cpp``) over weights packed for it.

Legend as in ``moe.fused_moe.experts``: E local experts, H = hidden_size, F = intermediate_size.
The pack is ``w [E, cols, K]`` -> ``[E, cols / 16, K, 16]`` (16 output columns per block, each
block one linear stream over K), made once from ``[w1; w3]`` (``[E, 2F, H]``) and ``w2``
(``[E, H, F]``); it needs H and 2F to be multiples of ``PACK_BLOCK``.

Where it runs: up to a number of rows per active expert measured once per machine, dtype and
expert shape (``kernel_max_rows``), against the path that runs otherwise. bfloat16: the kernel
widens it to float32 FMAs, so where oneDNN multiplies bfloat16 pairs natively (avx512_bf16, AMX)
it wins the large GEMMs of prefill, and where it cannot (AVX2) the kernel wins at every size.
float32: against the grouped GEMMs (the library's SGEMM, no second copy of the weights). Timings:
docs/hardware.md, "Experts".
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from moe.kernels import cpu_kernels
from moe.platforms.custom_op import is_tracing
from moe.platforms.plugins import current_platform

PACK_BLOCK = 16  # output columns per packed block (the kernel's kBlock)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The measurement (``measure_max_rows``) doubles the rows from 1 while they stay within
# both bounds (its largest call: ~10 ms on one core), taking the best of MEASURE_REPEATS calls
MEASURE_MAX_ROWS = 1024
MEASURE_MAX_MACS = 1 << 28
MEASURE_REPEATS = 5
TUNING_FILE = "tuning.json"  # beside the kernel build: {key: rows} (``kernel_max_rows``)

_tuning_lock = threading.Lock()
_max_rows: dict[str, float] = {}  # this process's answers, by the full key


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


def best_seconds(fn: Callable[[], object], repeats: int = MEASURE_REPEATS) -> float:
    """The shortest wall time of ``repeats`` calls of ``fn`` in seconds, after one untimed call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_max_rows(seconds: Callable[[bool, int], float], expert_elements: int) -> float:
    """The largest row count r of 1, 2, 4, ... at which the kernel (``seconds(True, r)``: one
    expert's rows) took no longer than the other path (``seconds(False, r)``); 0 if it lost at
    1 row, ``inf`` if it won at every count measured: up to ``MEASURE_MAX_ROWS`` rows and
    ``MEASURE_MAX_MACS`` r x ``expert_elements`` (3 H F), but at least 1 row."""
    rows, won = 1, 0.0
    while rows == 1 or (rows <= MEASURE_MAX_ROWS and rows * expert_elements <= MEASURE_MAX_MACS):
        if seconds(True, rows) > seconds(False, rows):
            return won
        won, rows = float(rows), rows * 2
    return math.inf


def tuning_path(kernels: ModuleType) -> Path:
    """The tuning file of a kernel build: in its directory, so it is per kernel source, ISA, torch
    and Python version, like the build (``moe.kernels``)."""
    return Path(kernels.__file__).parent / TUNING_FILE


def kernel_max_rows(kernels: ModuleType, experts: str, measure: Callable[[], float]) -> float:
    """The rows per active expert up to which the kernel serves ``experts`` (dtype and shape,
    e.g. ``"torch.bfloat16 H=2048 F=1408"``): ``measure()`` (``measure_max_rows``) once per
    machine, kept by its key (experts, threads, CPU model and the ISA caps) in the build's
    ``tuning_path``, so later starts read it instead and every start on this machine takes the
    same paths (they round differently). An unreadable or unwritable file only costs the
    measurement. Thread-safe."""
    cap = current_platform().cpu_capability()
    key = (
        f"{experts} threads={torch.get_num_threads()} cpu={cap.model_name} "
        f"torch_isa={cap.torch_capability} onednn_isa={os.environ.get('ONEDNN_MAX_CPU_ISA', '')}"
    )
    with _tuning_lock:
        if key not in _max_rows:
            path = tuning_path(kernels)
            stored = _read_tuning(path)
            if not isinstance(stored.get(key), int | float):
                stored = {**_read_tuning(path), key: measure()}
                _write_tuning(path, stored)
            _max_rows[key] = float(stored[key])
        return _max_rows[key]


def _read_tuning(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _write_tuning(path: Path, stored: dict) -> None:
    """Write ``stored`` whole under a temporary name, then rename it: a reader (another rank)
    sees the old file or the new one, never a part."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        temporary.write_text(json.dumps(stored, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
