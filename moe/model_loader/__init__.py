"""Checkpoint loading: ``config.json`` and safetensors (each EP rank reads only its experts)."""

from moe.model_loader.loader import LoadStats, check_checkpoint, load_checkpoint, load_config

__all__ = ["LoadStats", "check_checkpoint", "load_checkpoint", "load_config"]
