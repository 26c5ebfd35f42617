"""Graph mode: the model's forward traced per padding bucket, cut at its splitting ops (attention
cores, MoE kernels: ``splitting_op``), its pieces compiled (CPU) or captured (CUDA)."""

from moe.compilation.config import (
    DEFAULT_CAPTURE_SIZES,
    bucket_for,
    parse_compilation_config,
    resolve_capture_sizes,
)
from moe.compilation.piecewise import CaptureStats, GraphModeModel
from moe.compilation.splitting import pad_rows, splitting_op

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "CaptureStats",
    "GraphModeModel",
    "bucket_for",
    "pad_rows",
    "parse_compilation_config",
    "resolve_capture_sizes",
    "splitting_op",
]
