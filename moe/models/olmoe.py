"""OLMoE (arXiv:2409.02060): GQA with q_norm / k_norm (and clip_qkv), softmax routing, no shared
experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.models.hf_config import bool_field, common_fields, float_field, int_field
from moe.models.spec import ArchitectureSpec


def parse_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``OlmoeConfig`` fields -> ``MoEModelConfig`` keyword arguments."""
    bias = bool_field(d, "attention_bias", False)
    return {
        **common_fields(d, 10000.0),
        "rms_norm_eps": float_field(d, "rms_norm_eps", 1e-5),
        "num_experts": int_field(d, "num_experts"),
        "norm_topk_prob": bool_field(d, "norm_topk_prob", False),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "clip_qkv": float_field(d, "clip_qkv", None),
    }


SPEC = ArchitectureSpec(
    model_type="olmoe", architecture="OlmoeForCausalLM", parse_config=parse_config
)
