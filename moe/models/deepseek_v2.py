"""DeepSeek-V2 (arXiv:2405.04434): MLA, dense first layers, shared experts, greedy /
group-limited routing in float32. ``moe.models.deepseek_v3`` reuses its MLA and MoE fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.models.hf_config import bool_field, common_fields, float_field, int_field
from moe.models.spec import ArchitectureSpec


def mla_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Shapes of DeepSeek's multi-head latent attention (one latent for all heads)."""
    fields = {
        "o_bias": bool_field(d, "attention_bias", False),
        "qkv_bias": bool_field(d, "attention_bias", False),
        "q_lora_rank": int_field(d, "q_lora_rank", None),
        "kv_lora_rank": int_field(d, "kv_lora_rank"),
        "qk_nope_head_dim": int_field(d, "qk_nope_head_dim"),
        "qk_rope_head_dim": int_field(d, "qk_rope_head_dim"),
        "v_head_dim": int_field(d, "v_head_dim"),
        "num_key_value_heads": int_field(d, "num_attention_heads"),
    }
    fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    return fields


def deepseek_moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Routed and shared experts and the routing options V2 and V3 read alike.

    Raises:
        ValueError: ``moe_layer_freq`` other than 1, or a bad field.
    """
    moe_layer_freq = int_field(d, "moe_layer_freq", 1)
    if moe_layer_freq != 1:
        raise ValueError(f"moe_layer_freq {moe_layer_freq} is not supported; supported: [1]")
    moe_size = int_field(d, "moe_intermediate_size")
    return {
        "num_experts": int_field(d, "n_routed_experts"),
        "moe_intermediate_size": moe_size,
        "shared_intermediate_size": moe_size * int_field(d, "n_shared_experts", 0, minimum=0),
        "n_group": int_field(d, "n_group", 1),
        "topk_group": int_field(d, "topk_group", 1),
        "routed_scaling_factor": float_field(d, "routed_scaling_factor", 1.0),
    }


def check_scoring_func(d: Mapping[str, Any], model_type: str, scoring: str) -> str:
    """``scoring`` if ``config.json`` names no other; ValueError if it does."""
    if d.get("scoring_func") not in (None, scoring):
        raise ValueError(f"scoring_func {d['scoring_func']!r} is not supported for {model_type}")
    return scoring


def parse_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``DeepseekV2Config`` fields -> ``MoEModelConfig`` keyword arguments."""
    return {
        **common_fields(d, 10000.0),
        **deepseek_moe_fields(d),
        **mla_fields(d),
        # transformers' DeepseekV2TopkRouter never renormalises (DeepSeek-V2 checkpoints all set
        # norm_topk_prob false)
        "norm_topk_prob": False,
        "scoring_func": check_scoring_func(d, "deepseek_v2", "softmax"),
        "topk_method": d.get("topk_method") or "greedy",
        "rope_interleave": True,  # DeepSeek-V2 always rotates interleaved pairs (complex form)
    }


def first_k_dense(d: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Dense MLPs in the first ``first_k_dense_replace`` layers, MoE after."""
    first_dense = int_field(d, "first_k_dense_replace", 0, minimum=0)
    return tuple(i >= first_dense for i in range(num_layers))


SPEC = ArchitectureSpec(
    model_type="deepseek_v2",
    architecture="DeepseekV2ForCausalLM",
    parse_config=parse_config,
    attention="mla",
    moe_layers=first_k_dense,
    shared_experts="shared_experts",
    router_dtype="float32",
)
