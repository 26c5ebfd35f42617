"""Graph mode: pure-compute pieces of the decoder as compiled (CPU) or captured (CUDA) graphs per
padding bucket; attention core and MoE communication stay eager."""

from moe.compilation.config import (
    DEFAULT_CAPTURE_SIZES,
    bucket_for,
    parse_compilation_config,
    resolve_capture_sizes,
)
from moe.compilation.piecewise import CaptureStats, GraphModeModel, pad_rows

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "CaptureStats",
    "GraphModeModel",
    "bucket_for",
    "pad_rows",
    "parse_compilation_config",
    "resolve_capture_sizes",
]
