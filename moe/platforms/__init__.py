"""Per-platform op dispatch: ``CustomOp`` (``forward_native`` reference, ``forward_cpu`` /
``forward_cuda`` / ``forward_oot`` fast paths), the platforms, and entry-point plugins."""

from moe.platforms.custom_op import CustomOp, get_custom_ops, parse_custom_ops, set_custom_ops
from moe.platforms.interface import CpuPlatform, CudaPlatform, Platform
from moe.platforms.plugins import current_platform, set_current_platform

__all__ = [
    "CpuPlatform",
    "CudaPlatform",
    "CustomOp",
    "Platform",
    "current_platform",
    "get_custom_ops",
    "parse_custom_ops",
    "set_current_platform",
    "set_custom_ops",
]
