"""DeepSeek-V3 (arXiv:2412.19437): as DeepSeek-V2, with sigmoid scores + correction bias and
no-aux-loss grouped top-k."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.models.deepseek_v2 import (
    check_scoring_func,
    deepseek_moe_fields,
    first_k_dense,
    mla_fields,
)
from moe.models.hf_config import bool_field, common_fields
from moe.models.spec import ArchitectureSpec


def parse_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``DeepseekV3Config`` fields -> ``MoEModelConfig`` keyword arguments."""
    return {
        **common_fields(d, 10000.0),
        **deepseek_moe_fields(d),
        **mla_fields(d),
        "norm_topk_prob": bool_field(d, "norm_topk_prob", True),
        "scoring_func": check_scoring_func(d, "deepseek_v3", "sigmoid"),
        "topk_method": "noaux_tc",
        "rope_interleave": bool_field(d, "rope_interleave", True),
    }


SPEC = ArchitectureSpec(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    parse_config=parse_config,
    attention="mla",
    moe_layers=first_k_dense,
    shared_experts="shared_experts",
    router_dtype="float32",
)
