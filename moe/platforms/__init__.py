"""Platforms: one object per device family that answers every device question (``Platform``,
``current_platform()``), the CPU's capability and probes, per-platform op dispatch
(``CustomOp``: ``forward_native`` reference, ``forward_cpu`` / ``forward_cuda`` / ``forward_oot``
fast paths) and entry-point plugins."""

from moe.platforms.cpu_capability import CpuCapability, detect_cpu_capability
from moe.platforms.custom_op import CustomOp, get_custom_ops, parse_custom_ops, set_custom_ops
from moe.platforms.interface import (
    ComputeDtype,
    ConfigUpdate,
    CpuPlatform,
    CudaPlatform,
    DeviceMemory,
    Float32PackLimits,
    Platform,
)
from moe.platforms.plugins import current_platform, platform_for, set_current_platform

__all__ = [
    "ComputeDtype",
    "ConfigUpdate",
    "CpuCapability",
    "CpuPlatform",
    "CudaPlatform",
    "CustomOp",
    "DeviceMemory",
    "Float32PackLimits",
    "Platform",
    "current_platform",
    "detect_cpu_capability",
    "get_custom_ops",
    "parse_custom_ops",
    "platform_for",
    "set_current_platform",
    "set_custom_ops",
]
