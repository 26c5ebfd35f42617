"""Qwen3-MoE (Qwen3 technical report, arXiv:2505.09388): GQA with an RMSNorm over each head's q
and k (before RoPE), no shared expert, softmax top-k with ``norm_topk_prob``, sparse-step layers
as Qwen2-MoE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.models import qwen2_moe
from moe.models.hf_config import bool_field, common_fields, int_field
from moe.models.spec import ArchitectureSpec


def num_experts(d: Mapping[str, Any]) -> int:
    """``num_experts`` (Qwen's checkpoints), or ``num_local_experts``, the name transformers 5
    writes (its config's attribute map)."""
    return int_field(d, "num_experts" if "num_experts" in d else "num_local_experts", minimum=0)


def parse_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``Qwen3MoeConfig`` fields -> ``MoEModelConfig`` keyword arguments.

    Raises:
        ValueError: ``use_sliding_window`` true (not supported) or a bad field.
    """
    if bool_field(d, "use_sliding_window", False):
        raise ValueError("qwen3_moe with use_sliding_window=true is not supported")
    bias = bool_field(d, "attention_bias", False)
    return {
        **common_fields(d, 10000.0),
        "num_experts": num_experts(d),
        "moe_intermediate_size": int_field(d, "moe_intermediate_size"),
        "norm_topk_prob": bool_field(d, "norm_topk_prob", False),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "qk_norm_per_head": True,
    }


def moe_layers(d: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen2-MoE's rule: sparse where ``(i + 1) % decoder_sparse_step == 0`` and i is not in
    ``mlp_only_layers``."""
    return qwen2_moe.moe_layers({**d, "num_experts": num_experts(d)}, num_layers)


SPEC = ArchitectureSpec(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    parse_config=parse_config,
    moe_layers=moe_layers,
)
