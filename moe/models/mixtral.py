"""Mixtral (Jiang et al. 2024, arXiv:2401.04088): GQA, top-2 softmax routing, no shared experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.fused_moe.experts import MIXTRAL_EXPERT_NAMES
from moe.models.hf_config import common_fields, float_field, int_field
from moe.models.spec import ArchitectureSpec


def parse_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``MixtralConfig`` fields -> ``MoEModelConfig`` keyword arguments."""
    return {
        **common_fields(d, 1e6),
        "rms_norm_eps": float_field(d, "rms_norm_eps", 1e-5),
        "num_experts": int_field(d, "num_local_experts"),
    }


SPEC = ArchitectureSpec(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    parse_config=parse_config,
    moe_block="block_sparse_moe",
    expert_names=MIXTRAL_EXPERT_NAMES,
)
