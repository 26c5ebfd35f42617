"""Device presets for the roofline: peak FLOP/s per dtype, memory bandwidth, achieved fractions.

Peaks are the vendors' dense (no sparsity) numbers; the achieved fractions and the per-kernel floor
are what the best published kernels reach on these parts, each with its source in ``sources``.
``this-machine`` measures a GEMM, a copy and a tiny op with torch instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

DTYPES = ("fp8", "bf16", "fp32")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or CPU core) as the roofline sees it.

    Fields: ``peak_tflops`` per dtype (dense, TFLOP/s); ``mem_tbps`` memory bandwidth (TB/s);
    ``gemm_efficiency`` the achieved fraction of the FLOP/s peak for GEMMs of >= 4096 rows,
    ``gemm_efficiency_small`` for <= 256 rows (log-interpolated between); ``mem_efficiency`` the
    achieved fraction of the bandwidth; ``kernel_us`` the floor of one kernel (launch or CUDA-graph
    node, µs); ``sources`` a citation per number.

    Raises:
        ValueError: a non-positive peak or bandwidth, or a fraction outside (0, 1].
    """

    name: str
    peak_tflops: dict[str, float]
    mem_tbps: float
    gemm_efficiency: float
    mem_efficiency: float
    gemm_efficiency_small: float | None = None  # None: gemm_efficiency
    kernel_us: float
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.peak_tflops or any(not v > 0 for v in self.peak_tflops.values()):
            raise ValueError(f"device {self.name}: peak_tflops must be > 0, got {self.peak_tflops}")
        if not self.mem_tbps > 0:
            raise ValueError(f"device {self.name}: mem_tbps must be > 0, got {self.mem_tbps}")
        for name in ("gemm_efficiency", "mem_efficiency", "gemm_efficiency_small"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"device {self.name}: {name} must be in (0, 1]")
        if self.kernel_us < 0:
            raise ValueError(f"device {self.name}: kernel_us must be >= 0, got {self.kernel_us}")

    def flops_per_s(self, dtype: str, rows: float = 4096) -> float:
        """Achieved FLOP/s for ``dtype`` on a GEMM of ``rows`` rows per group (fp8 falls back to
        bf16, bf16 to any other listed dtype, where the part has none).

        Raises:
            ValueError: unknown dtype.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        peaks = self.peak_tflops
        peak = peaks.get(dtype) or peaks.get("bf16") or next(iter(peaks.values()))
        return peak * 1e12 * self.efficiency(rows)

    def efficiency(self, rows: float) -> float:
        """The achieved fraction of peak FLOP/s at ``rows`` rows (see the class docstring)."""
        small = self.gemm_efficiency_small or self.gemm_efficiency
        x = min(max((math.log2(max(rows, 1)) - 8) / 4, 0.0), 1.0)  # 256 rows -> 0, 4096 -> 1
        return small + (self.gemm_efficiency - small) * x

    @property
    def bytes_per_s(self) -> float:
        return self.mem_tbps * 1e12 * self.mem_efficiency


# DeepGEMM README (2025-02, H800, FP8): grouped GEMMs 1093-1297 TFLOPS at 4096-8192 rows per
# group (0.55-0.66 of 1979); masked (decode) 815-932 TFLOPS at 256 rows (0.41-0.47); dense GEMMs
# of 64-128 rows move 1.5-2.7 TB/s (0.45-0.80 of 3.35 TB/s)
_HOPPER_SOURCES = {
    "gemm_efficiency": "DeepGEMM README 2025-02: contiguous grouped 1093-1297 TFLOPS -> 0.6",
    "gemm_efficiency_small": "DeepGEMM README 2025-02: masked grouped, 256 rows: 815-932 -> 0.45",
    "mem_efficiency": "DeepGEMM README 2025-02: 64-128-row GEMMs 1.5-2.7 TB/s -> 0.7",
    "kernel_us": (
        "assumption: ~4 µs launch gap and ramp of a small kernel in a CUDA graph (not published)"
    ),
}


def _hopper(name: str, mem_tbps: float, datasheet: str) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        peak_tflops={"fp8": 1979.0, "bf16": 989.0, "fp32": 67.0},
        mem_tbps=mem_tbps,
        gemm_efficiency=0.6,
        gemm_efficiency_small=0.45,
        mem_efficiency=0.7,
        kernel_us=4.0,
        sources={"peak_tflops, mem_tbps": datasheet, **_HOPPER_SOURCES},
    )


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "h100-sxm": _hopper("H100 SXM", 3.35, "NVIDIA H100 datasheet (SXM5, dense)"),
    "h800-sxm": _hopper("H800 SXM", 3.35, "NVIDIA H800 SXM5 product brief (dense; = H100 SXM)"),
    "h200": _hopper("H200 SXM", 4.8, "NVIDIA H200 datasheet (SXM, dense)"),
}


def measure_this_machine(dtype: str = "fp32", *, seconds: float = 0.3) -> DeviceSpec:
    """Peaks of this process's device, measured with torch on the CPU: a square GEMM (FLOP/s), a
    256 MiB copy (bytes/s) and a tiny op (kernel floor). The fractions are 1: measured = achieved.

    Raises:
        ValueError: unknown dtype.
    """
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    torch_dtype = torch.bfloat16 if dtype in ("bf16", "fp8") else torch.float32
    a = torch.randn(1024, 1024, dtype=torch_dtype)
    gemm_s = _time_per_call(lambda: a @ a, seconds)
    src = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    dst = torch.zeros_like(src)  # touched once here: the copy below measures bandwidth, not faults
    copy_s = _time_per_call(lambda: dst.copy_(src), seconds)
    tiny = torch.ones(8)
    tiny_s = _time_per_call(lambda: tiny + tiny, seconds / 3)
    peak = 2 * 1024**3 / gemm_s / 1e12
    return replace(
        DEVICE_PRESETS["h100-sxm"],
        name=f"this machine ({torch.get_num_threads()} threads)",
        peak_tflops={dtype: peak},
        mem_tbps=2 * src.numel() * 4 / copy_s / 1e12,  # read + write
        gemm_efficiency=1.0,
        gemm_efficiency_small=1.0,
        mem_efficiency=1.0,
        kernel_us=tiny_s * 1e6,
        sources={"all": "measured now: 1024^3 GEMM, 256 MiB copy, 8-element add (torch)"},
    )


def _time_per_call(fn, seconds: float) -> float:
    """Median seconds of one ``fn()`` over batches of calls filling ``seconds``."""
    fn()
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def resolve_device(name: str, dtype: str = "fp32") -> DeviceSpec:
    """A preset by name, or ``this-machine`` (measured now).

    Raises:
        ValueError: unknown name.
    """
    if name == "this-machine":
        return measure_this_machine(dtype)
    try:
        return DEVICE_PRESETS[name.lower()]
    except KeyError:
        names = ", ".join([*DEVICE_PRESETS, "this-machine"])
        raise ValueError(f"--device {name!r}: unknown; accepted: {names}") from None
