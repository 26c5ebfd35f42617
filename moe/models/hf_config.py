"""Per-architecture reading of a Hugging Face ``config.json`` into ``MoEModelConfig`` fields.

Field meanings and defaults follow transformers 5's configuration classes (``MixtralConfig``,
``DeepseekV2Config``, ``DeepseekV3Config``, ``Qwen2MoeConfig``, ``OlmoeConfig``); a default is used
only where transformers has the same one. ``KeyError`` for a missing required field is turned into a
``ValueError`` naming it by ``MoEModelConfig.from_hf_config``. Every field read is type- and
range-checked (``_int``, ``_float``, ``_bool``): a wrong value is a one-line ``ValueError`` naming
the field and what is accepted, never a silent truncation (``hidden_size: 64.5``) or a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

# model_type -> architecture class name in config.json
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
ROPE_TYPES = ("default", "yarn")
_REQUIRED = object()


def _bad(name: str, what: str, value: Any) -> ValueError:
    shown = "null" if value is None else repr(value)
    return ValueError(f"config.json: {name} must be {what}, got {shown[:80]}")


def _raw(d: Mapping[str, Any], name: str, default: Any) -> Any:
    """``d[name]``; ``default`` when absent or null. A required field (``_REQUIRED``): KeyError
    when absent, None when null (which the caller's type check then refuses)."""
    value = d.get(name)
    if value is None:
        if default is _REQUIRED:
            if name not in d:
                raise KeyError(name)
            return None
        return default
    return value


def _int(d: Mapping[str, Any], name: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
    """An integer field >= ``minimum`` (``default`` when absent or null; may be None)."""
    value = _raw(d, name, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _bad(name, f"an integer >= {minimum}", value)
    return value


def _float(
    d: Mapping[str, Any], name: str, default: Any = _REQUIRED, *, positive: bool = True
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
        raise _bad(name, "a finite number" + (" > 0" if positive else ""), value)
    return float(value)


def _bool(d: Mapping[str, Any], name: str, default: bool) -> bool:
    value = _raw(d, name, default)
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if not isinstance(value, list) else value
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise _bad("eos_token_id", "a token id >= 0 or a list of them", value)
    return tuple(ids)


def _rope(d: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """rope_theta and (for yarn) the scaling parameters.

    transformers >= 5 writes ``rope_parameters``; older checkpoints (e.g. DeepSeek-V2-Lite's) have a
    top-level ``rope_theta`` and a ``rope_scaling`` dict whose kind is under ``type``.
    """
    name = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    raw = d.get(name) or {}
    if not isinstance(raw, dict):
        raise _bad(name, "an object", raw)
    params = dict(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    theta = _float(params, "rope_theta", _float(d, "rope_theta", default_theta))
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
            _float(params, k, None, positive=False)
        _bool(params, "truncate", True)
        scaling = tuple(sorted((k, params[k]) for k in keep if params.get(k) is not None))
    return {"rope_theta": theta, "rope_scaling": scaling}


def _common(d: Mapping[str, Any], model_type: str, default_theta: float) -> dict[str, Any]:
    hidden_size = _int(d, "hidden_size")
    num_heads = _int(d, "num_attention_heads")
    # present: must be a number (null is not "the default")
    max_positions = _int(d, "max_position_embeddings") if "max_position_embeddings" in d else 4096
    return {
        "architecture": SUPPORTED_ARCHITECTURES[model_type],
        "vocab_size": _int(d, "vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": _int(d, "intermediate_size"),
        "num_hidden_layers": _int(d, "num_hidden_layers"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _int(d, "num_key_value_heads", num_heads),
        "head_dim": _int(d, "head_dim", hidden_size // num_heads),
        "num_experts_per_tok": _int(d, "num_experts_per_tok"),
        "rms_norm_eps": _float(d, "rms_norm_eps", 1e-6),
        "max_position_embeddings": max_positions,
        "eos_token_ids": _eos_ids(d.get("eos_token_id")),
        "tie_word_embeddings": _bool(d, "tie_word_embeddings", False),
        **_rope(d, default_theta),
    }


def _mixtral(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_common(d, "mixtral", 1e6),
        "rms_norm_eps": _float(d, "rms_norm_eps", 1e-5),
        "num_experts": _int(d, "num_local_experts"),
    }


def _deepseek(d: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    is_v3 = model_type == "deepseek_v3"
    num_layers = _int(d, "num_hidden_layers")
    first_dense = _int(d, "first_k_dense_replace", 0, minimum=0)
    moe_layer_freq = _int(d, "moe_layer_freq", 1)
    if moe_layer_freq != 1:
        raise ValueError(f"moe_layer_freq {moe_layer_freq} is not supported; supported: [1]")
    n_shared = _int(d, "n_shared_experts", 0, minimum=0)
    moe_size = _int(d, "moe_intermediate_size")
    if is_v3:
        topk_method, scoring = "noaux_tc", "sigmoid"
    else:
        topk_method, scoring = d.get("topk_method") or "greedy", "softmax"
    if d.get("scoring_func") not in (None, scoring):
        raise ValueError(f"scoring_func {d['scoring_func']!r} is not supported for {model_type}")
    fields = {
        **_common(d, model_type, 10000.0),
        "num_experts": _int(d, "n_routed_experts"),
        "moe_intermediate_size": moe_size,
        "moe_layers": tuple(i >= first_dense for i in range(num_layers)),
        "shared_intermediate_size": moe_size * n_shared,
        # transformers' DeepseekV2TopkRouter never renormalises (DeepSeek-V2 checkpoints all set
        # norm_topk_prob false); V3 honours norm_topk_prob (default true)
        "norm_topk_prob": _bool(d, "norm_topk_prob", True) if is_v3 else False,
        "scoring_func": scoring,
        "topk_method": topk_method,
        "n_group": _int(d, "n_group", 1),
        "topk_group": _int(d, "topk_group", 1),
        "routed_scaling_factor": _float(d, "routed_scaling_factor", 1.0),
        "attention_type": "mla",
        "o_bias": _bool(d, "attention_bias", False),
        "qkv_bias": _bool(d, "attention_bias", False),
        "q_lora_rank": _int(d, "q_lora_rank", None),
        "kv_lora_rank": _int(d, "kv_lora_rank"),
        "qk_nope_head_dim": _int(d, "qk_nope_head_dim"),
        "qk_rope_head_dim": _int(d, "qk_rope_head_dim"),
        "v_head_dim": _int(d, "v_head_dim"),
        # DeepSeek-V2 always rotates interleaved pairs (complex form); V3 when rope_interleave
        "rope_interleave": _bool(d, "rope_interleave", True) if is_v3 else True,
    }
    fields["num_key_value_heads"] = fields["num_attention_heads"]  # MLA: one latent for all heads
    fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    return fields


def _qwen2_moe(d: Mapping[str, Any]) -> dict[str, Any]:
    if _bool(d, "use_sliding_window", False):
        raise ValueError("qwen2_moe with use_sliding_window=true is not supported")
    num_layers = _int(d, "num_hidden_layers")
    step = _int(d, "decoder_sparse_step", 1)
    mlp_only_raw = d.get("mlp_only_layers") or []
    if not isinstance(mlp_only_raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_raw
    ):
        raise _bad("mlp_only_layers", "a list of layer indices", mlp_only_raw)
    mlp_only = set(mlp_only_raw)
    num_experts = _int(d, "num_experts", minimum=0)
    return {
        **_common(d, "qwen2_moe", 10000.0),
        "num_experts": num_experts,
        "moe_intermediate_size": _int(d, "moe_intermediate_size"),
        "moe_layers": tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        ),
        "shared_intermediate_size": _int(d, "shared_expert_intermediate_size", 0, minimum=0),
        "has_shared_expert_gate": bool(d.get("shared_expert_intermediate_size")),
        "norm_topk_prob": _bool(d, "norm_topk_prob", False),
        "qkv_bias": _bool(d, "qkv_bias", True),
    }


def _olmoe(d: Mapping[str, Any]) -> dict[str, Any]:
    bias = _bool(d, "attention_bias", False)
    return {
        **_common(d, "olmoe", 10000.0),
        "rms_norm_eps": _float(d, "rms_norm_eps", 1e-5),
        "num_experts": _int(d, "num_experts"),
        "norm_topk_prob": _bool(d, "norm_topk_prob", False),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "clip_qkv": _float(d, "clip_qkv", None),
    }


_PARSERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "mixtral": _mixtral,
    "deepseek_v2": lambda d: _deepseek(d, "deepseek_v2"),
    "deepseek_v3": lambda d: _deepseek(d, "deepseek_v3"),
    "qwen2_moe": _qwen2_moe,
    "olmoe": _olmoe,
}


def parse_hf_config(model_type: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """MoEModelConfig keyword arguments for a supported ``model_type`` (KeyError: missing field)."""
    return _PARSERS[model_type](d)
