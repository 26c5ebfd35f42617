"""Questions about the device a tensor lives on, answered here so that model code never tests
device-type strings (moe/platforms is where device differences live).

``is_host(device)``: whether tensors there are in host memory (``platform_for(device)``'s answer);
``grouped_mm_unavailable(device, dtype)``: why ``torch._grouped_mm`` cannot run there without a
host read (the experts' device path needs it not to).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from moe.platforms.cpu_capability import grouped_mm_probe, grouped_mm_unavailable_reason
from moe.platforms.plugins import platform_for

# (device, dtype) -> why torch._grouped_mm cannot run there without a host read, or None
_probed: dict[tuple[torch.device, torch.dtype], str | None] = {}


def is_host(device: torch.device) -> bool:
    """Whether tensors on ``device`` are in the host's memory (``Platform.is_host_memory`` of
    ``platform_for(device)``): read without a device sync, drawn by host generators."""
    return platform_for(device).is_host_memory


def grouped_mm_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` cannot run on ``device`` in ``dtype`` without reading to the
    host, or None. CPU: the platform's probe (``grouped_mm_unavailable_reason``); CUDA: the same
    tiny grouped GEMM (``grouped_mm_probe``) under ``torch.cuda.set_sync_debug_mode("error")``
    (torch's per-group fallback copies ``offs`` to the host, which then raises). Probed once per
    device and dtype, never during CUDA graph capture (not probed yet: a reason, not cached)."""
    if is_host(device):
        return grouped_mm_unavailable_reason(dtype)
    key = (device, dtype)
    if key not in _probed:
        if device.type != "cuda":
            return f"torch._grouped_mm is not probed on {device.type}"
        if torch.cuda.is_current_stream_capturing():
            return "torch._grouped_mm was not probed before CUDA graph capture"
        _probed[key] = grouped_mm_probe(dtype, device, functools.partial(_host_reads_raise, device))
    return _probed[key]


@contextlib.contextmanager
def _host_reads_raise(device: torch.device) -> Iterator[None]:
    """Inside: a host read on ``device`` raises (``torch.cuda.set_sync_debug_mode("error")``)."""
    torch.cuda.synchronize(device)
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
