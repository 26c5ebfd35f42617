"""The check before a caller runs one of our compiled CPU kernels instead of its torch path: every
tensor on the host, no trace running (a trace keeps the torch ops), and the kernels built for this
CPU's ISA (``moe.kernels.cpu_kernels``)."""

from __future__ import annotations

from types import ModuleType

from torch import Tensor

from moe.kernels import cpu_kernels
from moe.platforms.custom_op import is_tracing
from moe.platforms.device_probes import is_host
from moe.platforms.plugins import current_platform


def host_kernels(*tensors: Tensor) -> ModuleType | None:
    """``cpu_kernels`` of this CPU's ISA (``current_platform().cpu_capability().isa``) where every
    tensor of ``tensors`` is on the host and no trace runs, else None."""
    if is_tracing() or not all(is_host(t.device) for t in tensors):
        return None
    return cpu_kernels(current_platform().cpu_capability().isa)
