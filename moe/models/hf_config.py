"""Per-architecture reading of a Hugging Face ``config.json`` into ``MoEModelConfig`` fields.

Field meanings and defaults follow transformers 5's configuration classes (``MixtralConfig``,
``DeepseekV2Config``, ``DeepseekV3Config``, ``Qwen2MoeConfig``, ``OlmoeConfig``); a default is used
only where transformers has the same one. ``KeyError`` for a missing required field is turned into a
``ValueError`` naming it by ``MoEModelConfig.from_hf_config``.
"""

from __future__ import annotations

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


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(d: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """rope_theta and (for yarn) the scaling parameters.

    transformers >= 5 writes ``rope_parameters``; older checkpoints (e.g. DeepSeek-V2-Lite's) have a
    top-level ``rope_theta`` and a ``rope_scaling`` dict whose kind is under ``type``.
    """
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    theta = float(params.get("rope_theta", d.get("rope_theta", default_theta)))
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
        scaling = tuple(sorted((k, params[k]) for k in keep if params.get(k) is not None))
    return {"rope_theta": theta, "rope_scaling": scaling}


def _common(d: Mapping[str, Any], model_type: str, default_theta: float) -> dict[str, Any]:
    hidden_size = int(d["hidden_size"])
    num_heads = int(d["num_attention_heads"])
    return {
        "architecture": SUPPORTED_ARCHITECTURES[model_type],
        "vocab_size": int(d["vocab_size"]),
        "hidden_size": hidden_size,
        "intermediate_size": int(d["intermediate_size"]),
        "num_hidden_layers": int(d["num_hidden_layers"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(d.get("num_key_value_heads") or num_heads),
        "head_dim": int(d.get("head_dim") or hidden_size // num_heads),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(d.get("max_position_embeddings", 4096)),
        "eos_token_ids": _eos_ids(d.get("eos_token_id")),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
        **_rope(d, default_theta),
    }


def _mixtral(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_common(d, "mixtral", 1e6),
        "rms_norm_eps": float(d.get("rms_norm_eps", 1e-5)),
        "num_experts": int(d["num_local_experts"]),
    }


def _deepseek(d: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    is_v3 = model_type == "deepseek_v3"
    num_layers = int(d["num_hidden_layers"])
    first_dense = int(d.get("first_k_dense_replace") or 0)
    moe_layer_freq = int(d.get("moe_layer_freq") or 1)
    if moe_layer_freq != 1:
        raise ValueError(f"moe_layer_freq {moe_layer_freq} is not supported; supported: [1]")
    n_shared = int(d.get("n_shared_experts") or 0)
    moe_size = int(d["moe_intermediate_size"])
    if is_v3:
        topk_method, scoring = "noaux_tc", "sigmoid"
    else:
        topk_method, scoring = d.get("topk_method") or "greedy", "softmax"
    if d.get("scoring_func") not in (None, scoring):
        raise ValueError(f"scoring_func {d['scoring_func']!r} is not supported for {model_type}")
    fields = {
        **_common(d, model_type, 10000.0),
        "num_experts": int(d["n_routed_experts"]),
        "moe_intermediate_size": moe_size,
        "moe_layers": tuple(i >= first_dense for i in range(num_layers)),
        "shared_intermediate_size": moe_size * n_shared,
        # transformers' DeepseekV2TopkRouter never renormalises (DeepSeek-V2 checkpoints all set
        # norm_topk_prob false); V3 honours norm_topk_prob (default true)
        "norm_topk_prob": bool(d.get("norm_topk_prob", True)) if is_v3 else False,
        "scoring_func": scoring,
        "topk_method": topk_method,
        "n_group": int(d.get("n_group") or 1),
        "topk_group": int(d.get("topk_group") or 1),
        "routed_scaling_factor": float(d.get("routed_scaling_factor") or 1.0),
        "attention_type": "mla",
        "o_bias": bool(d.get("attention_bias", False)),
        "qkv_bias": bool(d.get("attention_bias", False)),
        "q_lora_rank": None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
        "kv_lora_rank": int(d["kv_lora_rank"]),
        "qk_nope_head_dim": int(d["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(d["qk_rope_head_dim"]),
        "v_head_dim": int(d["v_head_dim"]),
        # DeepSeek-V2 always rotates interleaved pairs (complex form); V3 when rope_interleave
        "rope_interleave": bool(d.get("rope_interleave", True)) if is_v3 else True,
    }
    fields["num_key_value_heads"] = fields["num_attention_heads"]  # MLA: one latent for all heads
    fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    return fields


def _qwen2_moe(d: Mapping[str, Any]) -> dict[str, Any]:
    if d.get("use_sliding_window"):
        raise ValueError("qwen2_moe with use_sliding_window=true is not supported")
    num_layers = int(d["num_hidden_layers"])
    step = int(d.get("decoder_sparse_step") or 1)
    mlp_only = {int(i) for i in d.get("mlp_only_layers") or ()}
    num_experts = int(d["num_experts"])
    return {
        **_common(d, "qwen2_moe", 10000.0),
        "num_experts": num_experts,
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "moe_layers": tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        ),
        "shared_intermediate_size": int(d.get("shared_expert_intermediate_size") or 0),
        "has_shared_expert_gate": bool(d.get("shared_expert_intermediate_size")),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "qkv_bias": bool(d.get("qkv_bias", True)),
    }


def _olmoe(d: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(d.get("attention_bias", False))
    clip = d.get("clip_qkv")
    return {
        **_common(d, "olmoe", 10000.0),
        "rms_norm_eps": float(d.get("rms_norm_eps", 1e-5)),
        "num_experts": int(d["num_experts"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "clip_qkv": None if clip is None else float(clip),
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
