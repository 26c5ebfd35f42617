"""Readers of Hugging Face ``config.json`` fields, shared by the architecture specs.

Each architecture module (``moe.models.mixtral``, ...) parses its own fields with these readers.
Field meanings and defaults follow transformers 5's configuration classes; a default is used only
where transformers has the same one. A missing required field raises ``KeyError`` (turned into a
``ValueError`` naming it by ``MoEModelConfig.from_hf_config``). Every field read is type- and
range-checked: a wrong value is a one-line ``ValueError`` naming the field and what is accepted,
never a silent truncation (``hidden_size: 64.5``) or a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

ROPE_TYPES = ("default", "yarn")
REQUIRED: Any = object()  # default of a required field: KeyError when absent


def bad_field(name: str, what: str, value: Any) -> ValueError:
    """The one-line error for field ``name`` holding ``value`` where ``what`` is accepted."""
    shown = "null" if value is None else repr(value)
    return ValueError(f"config.json: {name} must be {what}, got {shown[:80]}")


def _raw(d: Mapping[str, Any], name: str, default: Any) -> Any:
    """``d[name]``; ``default`` when absent or null. A required field (``REQUIRED``): KeyError
    when absent, None when null (which the caller's type check then refuses)."""
    value = d.get(name)
    if value is None:
        if default is REQUIRED:
            if name not in d:
                raise KeyError(name)
            return None
        return default
    return value


def int_field(d: Mapping[str, Any], name: str, default: Any = REQUIRED, *, minimum: int = 1) -> Any:
    """An integer field >= ``minimum`` (``default`` when absent or null; may be None)."""
    value = _raw(d, name, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise bad_field(name, f"an integer >= {minimum}", value)
    return value


def float_field(
    d: Mapping[str, Any], name: str, default: Any = REQUIRED, *, positive: bool = True
) -> Any:
    """A finite number field (> 0 when ``positive``; ``default`` when absent or null)."""
    value = _raw(d, name, default)
    if value is None and default is None:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        raise bad_field(name, "a finite number" + (" > 0" if positive else ""), value)
    return float(value)


def bool_field(d: Mapping[str, Any], name: str, default: bool) -> bool:
    value = _raw(d, name, default)
    if not isinstance(value, bool):
        raise bad_field(name, "true or false", value)
    return value


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if not isinstance(value, list) else value
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise bad_field("eos_token_id", "a token id >= 0 or a list of them", value)
    return tuple(ids)


def rope_fields(d: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """rope_theta and (for yarn) the scaling parameters.

    transformers >= 5 writes ``rope_parameters``; older checkpoints (e.g. DeepSeek-V2-Lite's) have a
    top-level ``rope_theta`` and a ``rope_scaling`` dict whose kind is under ``type``.
    """
    name = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    raw = d.get(name) or {}
    if not isinstance(raw, dict):
        raise bad_field(name, "an object", raw)
    params = dict(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    theta = float_field(params, "rope_theta", float_field(d, "rope_theta", default_theta))
    scaling = None
    if rope_type == "yarn":
        keep = (
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        )
        for k in keep[:-1]:  # every yarn parameter but truncate is a number
            float_field(params, k, None, positive=False)
        bool_field(params, "truncate", True)
        scaling = tuple(sorted((k, params[k]) for k in keep if params.get(k) is not None))
    return {"rope_theta": theta, "rope_scaling": scaling}


def common_fields(d: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """The fields every architecture reads alike (sizes, heads, norm eps, eos, RoPE); an
    architecture overrides the ones it reads differently."""
    hidden_size = int_field(d, "hidden_size")
    num_heads = int_field(d, "num_attention_heads")
    # present: must be a number (null is not "the default")
    max_positions = (
        int_field(d, "max_position_embeddings") if "max_position_embeddings" in d else 4096
    )
    return {
        "vocab_size": int_field(d, "vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": int_field(d, "intermediate_size"),
        "num_hidden_layers": int_field(d, "num_hidden_layers"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int_field(d, "num_key_value_heads", num_heads),
        "head_dim": int_field(d, "head_dim", hidden_size // num_heads),
        "num_experts_per_tok": int_field(d, "num_experts_per_tok"),
        "rms_norm_eps": float_field(d, "rms_norm_eps", 1e-6),
        "max_position_embeddings": max_positions,
        "eos_token_ids": eos_ids(d.get("eos_token_id")),
        "tie_word_embeddings": bool_field(d, "tie_word_embeddings", False),
        **rope_fields(d, default_theta),
    }
