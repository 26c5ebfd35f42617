"""Qwen2-MoE (Qwen1.5-MoE, arXiv:2407.10671): GQA with qkv bias, a shared expert gated by a
sigmoid, sparse-step layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.models.hf_config import bad_field, bool_field, common_fields, int_field
from moe.models.spec import ArchitectureSpec


def parse_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``Qwen2MoeConfig`` fields -> ``MoEModelConfig`` keyword arguments.

    Raises:
        ValueError: ``use_sliding_window`` true (not supported) or a bad field.
    """
    if bool_field(d, "use_sliding_window", False):
        raise ValueError("qwen2_moe with use_sliding_window=true is not supported")
    return {
        **common_fields(d, 10000.0),
        "num_experts": int_field(d, "num_experts", minimum=0),
        "moe_intermediate_size": int_field(d, "moe_intermediate_size"),
        "shared_intermediate_size": int_field(d, "shared_expert_intermediate_size", 0, minimum=0),
        "norm_topk_prob": bool_field(d, "norm_topk_prob", False),
        "qkv_bias": bool_field(d, "qkv_bias", True),
    }


def moe_layers(d: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Sparse where ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``."""
    step = int_field(d, "decoder_sparse_step", 1)
    mlp_only = d.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only
    ):
        raise bad_field("mlp_only_layers", "a list of layer indices", mlp_only)
    has_experts = int_field(d, "num_experts", minimum=0) > 0
    return tuple(
        has_experts and i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers)
    )


SPEC = ArchitectureSpec(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    parse_config=parse_config,
    moe_layers=moe_layers,
    shared_experts="shared_expert",
    has_shared_expert_gate=True,
)
