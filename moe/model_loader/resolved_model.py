"""The model to serve, resolved from ``--model`` / ``--load-format`` before any process group
exists, and its weights loaded once the rank's model is built.

Three sources: a checkpoint directory (config.json and safetensors), ``--load-format dummy``
(a config.json or a preset's shapes, seeded random weights), or none (the embedded default,
seeded random weights). Takes plain values, not the engine's flags object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe.model_loader.loader import (
    check_checkpoint,
    init_random_weights,
    load_checkpoint,
    load_config,
)
from moe.model_loader.presets import EMBEDDED_MODEL_CONFIG, PRESETS, config_from_hf
from moe.models.config import MoEModelConfig
from moe.models.registry import config_parameter_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedModel:
    """The model to serve, resolved and checked before any process group exists.
    ``checkpoint_dir``: ``--model`` (a directory, or a preset name under ``load_format``
    ``"dummy"``); None: the embedded default with seeded random weights."""

    config: MoEModelConfig
    checkpoint_dir: str | None
    max_model_len: int
    seed: int
    load_format: str = "auto"

    @property
    def has_random_weights(self) -> bool:
        """Seeded random weights (the embedded default or ``--load-format dummy``)."""
        return self.checkpoint_dir is None or self.load_format == "dummy"


def resolve_model(
    model: str | None, *, load_format: str, max_model_len: int | None, seed: int
) -> ResolvedModel:
    """Read and check ``model`` (config.json and safetensors headers; with ``load_format``
    ``"dummy"`` config.json or a preset name alone) or take the embedded default (None).
    ``max_model_len`` None: the model's ``max_position_embeddings``.

    Raises:
        ValueError: unsupported architecture (naming the supported ones), a malformed config, or
            ``--max-model-len`` beyond the model's ``max_position_embeddings``.
        OSError: a missing or unreadable checkpoint directory or file.
    """
    if model is None:
        config = MoEModelConfig.from_hf_config(EMBEDDED_MODEL_CONFIG)
    elif load_format == "dummy":  # config.json (or a preset) only: seeded random weights
        config = _dummy_config(model)
    else:
        if not Path(model).is_dir():
            raise FileNotFoundError(f"--model {model!r}: no such checkpoint directory")
        config = check_checkpoint(model)  # parses config.json and safetensors headers
    max_model_len = max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    return ResolvedModel(
        config=config,
        checkpoint_dir=model,
        max_model_len=max_model_len,
        seed=seed,
        load_format=load_format,
    )


def _dummy_config(model: str) -> MoEModelConfig:
    """``--model``'s config under ``--load-format dummy``: a directory's ``config.json``, else a
    preset's (``moe.model_loader.presets``, e.g. ``OLMoE-1B-7B``: shapes without a download).

    Raises:
        FileNotFoundError: neither a directory nor a preset name (the presets are listed).
    """
    if Path(model).is_dir():
        return load_config(model)
    preset = PRESETS.get(model.lower())
    if preset is None:
        names = sorted(p.name for p in PRESETS.values())
        raise FileNotFoundError(
            f"--model {model!r}: no such checkpoint directory, nor a preset ({names}) for "
            "--load-format dummy"
        )
    return config_from_hf(preset.hf_config)


def load_weights(model: nn.Module, resolved: ResolvedModel) -> None:
    """Fill ``model`` (built by ``build_model`` for ``resolved.config``) with its weights: the
    checkpoint's, or seeded random ones. Raises as ``load_checkpoint`` does."""
    if resolved.has_random_weights:
        # dummy weights (real shapes, e.g. 30B parameters) are drawn on the device; the
        # embedded default's on the host, alike on every device
        is_dummy = resolved.load_format == "dummy"
        init_random_weights(model, seed=resolved.seed, on_device=is_dummy)
    else:
        load_checkpoint(model, resolved.checkpoint_dir)


def check_parameter_memory(
    resolved: ResolvedModel, *, ep_size: int, dtype: torch.dtype, available_bytes: int
) -> None:
    """Refuse a model whose parameters on one rank (its share of the routed experts, in
    ``dtype``: ``config_parameter_bytes``, the start-up memory line's count) exceed
    ``available_bytes`` (the platform's ``available_memory`` of the rank's device), before
    anything is allocated.

    Raises:
        ValueError: one line naming the bytes needed, the config's sizes and the bytes available.
    """
    config = resolved.config
    need = sum(config_parameter_bytes(config, ep_size=ep_size, dtype=dtype).values())
    if need <= available_bytes:
        return
    model = resolved.checkpoint_dir
    if model is None:
        what, source = "the embedded model", "embedded config"
    else:
        what = "--load-format dummy" if resolved.load_format == "dummy" else f"--model {model}"
        source = "config.json" if Path(model).is_dir() else f"preset {model}"
    sizes = (
        f"{config.num_experts} experts over {ep_size} EP rank(s), {config.num_hidden_layers} "
        f"layers, hidden_size {config.hidden_size}, vocab_size {config.vocab_size}; "
        f"{str(dtype).removeprefix('torch.')}"
    )
    raise ValueError(
        f"{what}: the parameters need {format_bytes(need)} per rank ({source}: {sizes}), more "
        f"than the {format_bytes(available_bytes)} available"
    )


def format_bytes(num_bytes: int) -> str:
    """``3.7 TiB``, ``22.1 GiB``, ``12.0 MiB`` (binary units, one decimal)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"
