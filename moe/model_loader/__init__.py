"""Model loading: the model to serve resolved from ``--model`` / ``--load-format`` (a checkpoint,
a config or preset's shapes, or the embedded default), ``config.json`` and safetensors (each EP
rank reads only its experts), and the named configs (``presets``)."""

from moe.model_loader.loader import LoadStats, check_checkpoint, load_checkpoint, load_config
from moe.model_loader.presets import EMBEDDED_MODEL_CONFIG, PRESETS, ModelPreset
from moe.model_loader.resolved_model import (
    ResolvedModel,
    check_parameter_memory,
    format_bytes,
    load_weights,
    resolve_model,
)

__all__ = [
    "EMBEDDED_MODEL_CONFIG",
    "PRESETS",
    "LoadStats",
    "ModelPreset",
    "ResolvedModel",
    "check_checkpoint",
    "check_parameter_memory",
    "format_bytes",
    "load_checkpoint",
    "load_config",
    "load_weights",
    "resolve_model",
]
