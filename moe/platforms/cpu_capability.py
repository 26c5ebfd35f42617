"""What this CPU can run: ``CpuCapability`` (vector ISA, vendor, flags; ``MOE_DBO_CPU_ISA`` caps
it) and probes that run a path once on a tiny tensor (``onednn_linear_unavailable_reason``,
``grouped_mm_unavailable_reason``), each answered once per process. How the ISA is chosen and why
paths are probed: docs/hardware.md, "CPU capability and probes"."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# vector ISAs our kernels are built for, lowest first; "default" builds nothing
CPU_ISAS = ("default", "avx2", "avx512", "avx512_bf16")
_TORCH_CAPABILITY_ISA = {
    "AVX512": "avx512",
    "AVX2": "avx2",
}  # anything else (DEFAULT, NEON...): default
ISA_LABELS = {
    "default": "no vector ISA",
    "avx2": "AVX2",
    "avx512": "AVX-512",
    "avx512_bf16": "AVX-512 + avx512_bf16",
}
CPU_ISA_ENV = "MOE_DBO_CPU_ISA"


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuCapability:
    """This CPU as the engine sees it.

    Attributes:
        isa: ``"avx512_bf16"``, ``"avx512"``, ``"avx2"`` or ``"default"``: what our kernels are
            built for.
        torch_capability: torch's own dispatch level (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...).
        vendor: ``GenuineIntel``, ``AuthenticAMD``, ... or ``"unknown"``.
        model_name: the CPU's model name, or ``"unknown"``.
        flags: the CPU's feature flags (``/proc/cpuinfo``), empty where unreadable.
        cap: the ``MOE_DBO_CPU_ISA`` value that lowered ``isa``, else None.
    """

    isa: str
    torch_capability: str
    vendor: str
    model_name: str
    flags: frozenset[str]
    cap: str | None = None

    @property
    def has_avx512_bf16(self) -> bool:
        return self.isa == "avx512_bf16"

    @property
    def has_amx(self) -> bool:
        return self.isa == "avx512_bf16" and "amx_tile" in self.flags

    def describe(self) -> str:
        """One line for logs, e.g. ``"AVX-512 + avx512_bf16 (AuthenticAMD, AMD EPYC)"``."""
        capped = f", capped by {CPU_ISA_ENV}={self.cap}" if self.cap else ""
        isa = " + ".join([ISA_LABELS[self.isa], *(["AMX"] if self.has_amx else [])])
        return f"{isa} ({self.vendor}, {self.model_name}{capped})"


def _read_cpuinfo(path: str) -> tuple[str, str, frozenset[str]]:
    vendor = model = "unknown"
    flags: frozenset[str] = frozenset()
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and vendor == "unknown":
                    vendor = value.strip()
                elif key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if vendor != "unknown" and model != "unknown" and flags:
                    break
    except OSError:
        pass
    return vendor, model, flags


def parse_isa_cap(text: str | None) -> str | None:
    """``MOE_DBO_CPU_ISA``'s value -> an entry of ``CPU_ISAS`` (None when unset or empty).

    Raises:
        ValueError: any other value (naming the accepted ones).
    """
    if text is None or not text.strip():
        return None
    value = text.strip().lower()
    if value == "none":
        value = "default"
    if value not in CPU_ISAS:
        raise ValueError(f"{CPU_ISA_ENV}={text!r} is not one of {CPU_ISAS}")
    return value


def detect_cpu_capability(
    *, environ: dict[str, str] | None = None, cpuinfo_path: str = "/proc/cpuinfo"
) -> CpuCapability:
    """Read this CPU's capability now (``CpuPlatform.cpu_capability`` caches it).

    Raises:
        ValueError: a bad ``MOE_DBO_CPU_ISA``.
    """
    env = os.environ if environ is None else environ
    torch_capability = torch.backends.cpu.get_cpu_capability()
    isa = _TORCH_CAPABILITY_ISA.get(torch_capability, "default")
    vendor, model, flags = _read_cpuinfo(cpuinfo_path)
    if isa == "avx512" and "avx512_bf16" in flags:
        isa = "avx512_bf16"
    cap = parse_isa_cap(env.get(CPU_ISA_ENV))
    lowered = cap is not None and CPU_ISAS.index(cap) < CPU_ISAS.index(isa)
    return CpuCapability(
        isa=cap if lowered else isa,
        torch_capability=torch_capability,
        vendor=vendor,
        model_name=model,
        flags=flags,
        cap=cap if lowered else None,
    )


def _probe_bound(dtype: torch.dtype, k: int) -> float:
    # a k-term dot product of values in [-1, 1], rounded once: a few ulps of k at this precision
    return 4 * k * torch.finfo(dtype).eps


@functools.cache
def onednn_linear_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot run a prepacked linear (``torch.ops.mkldnn._reorder_linear_weight`` +
    ``_linear_pointwise``) in ``dtype`` on this CPU, or None if a tiny one ran and matched
    ``F.linear``. Probed once per dtype and process."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"this torch ({torch.__version__}) has no torch.ops.mkldnn.{name}"
    generator = torch.Generator().manual_seed(0)
    weight = (torch.rand(32, 64, generator=generator) * 2 - 1).to(dtype)
    x = (torch.rand(5, 64, generator=generator) * 2 - 1).to(dtype)
    try:
        packed = ops._reorder_linear_weight(weight, None)
        out = ops._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as e:
        return f"oneDNN refused a {dtype} linear on this CPU: {str(e).strip().splitlines()[0]}"
    error = (out.double() - F.linear(x.double(), weight.double())).abs().max().item()
    if not error <= _probe_bound(dtype, 64):
        return f"oneDNN's {dtype} linear differs from F.linear by {error:.3g} on this CPU"
    return None


def grouped_mm_probe(
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    guard: Callable[[], AbstractContextManager] = nullcontext,
) -> str | None:
    """Why a tiny ``torch._grouped_mm`` in ``dtype`` on ``device``, run inside ``guard()``, raised
    or differs from per-group ``torch.mm``, or None. Its ``b`` has the experts' weights' layout
    (column-major, as ``w.transpose(1, 2)``)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    generator = torch.Generator().manual_seed(0)
    a = (torch.rand(6, 16, generator=generator) * 2 - 1).to(device, dtype)
    b = (torch.rand(2, 8, 16, generator=generator) * 2 - 1).to(device, dtype).transpose(1, 2)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=device)
    try:
        with guard():
            out = torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm on {device} refused {dtype}: {str(e).strip().splitlines()[0]}"
    ref = torch.cat([a[:2].double() @ b[0].double(), a[2:].double() @ b[1].double()])
    error = (out.double() - ref).abs().max().item()  # host read: once, at the probe
    if not error <= _probe_bound(dtype, 16):
        return f"torch._grouped_mm on {device} in {dtype} differs from torch.mm by {error:.3g}"
    return None


@functools.cache
def grouped_mm_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` cannot run in ``dtype`` on this CPU (``grouped_mm_probe``), or
    None. Probed once per dtype and process."""
    return grouped_mm_probe(dtype)
