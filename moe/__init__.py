"""moe: model side — config, router, modular fused-MoE kernel, experts, attention, models, loading."""

from moe.attention import PagedAttention, paged_attention, write_kv_cache
from moe.build import MODEL_REGISTRY, build_model, make_prepare_finalize
from moe.causal_lm import PARAM_CATEGORIES, MoEForCausalLM, parameter_bytes
from moe.config import SUPPORTED_ARCHITECTURES, MoEModelConfig
from moe.custom_op import CustomOp, get_custom_ops, parse_custom_ops, set_custom_ops
from moe.experts import TorchExperts
from moe.fused_moe import FusedMoE
from moe.layers import DenseMLP, RMSNorm, RotaryEmbedding, SiluAndMul, rotate_half, swiglu
from moe.loader import (
    LoadStats,
    check_checkpoint,
    checkpoint_targets,
    init_random_weights,
    load_checkpoint,
    load_config,
)
from moe.mixtral import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
)
from moe.mla import MLAAttention, PagedMLACache
from moe.modular_kernel import (
    All2AllPrepareAndFinalize,
    CompletedHandle,
    FusedMoEModularKernel,
    FusedMoEPrepareAndFinalize,
    NoEPPrepareAndFinalize,
)
from moe.platforms import CpuPlatform, CudaPlatform, Platform, current_platform
from moe.router import Router, RoutingConfig, RoutingResult, select_experts

__all__ = [
    "MODEL_REGISTRY",
    "PARAM_CATEGORIES",
    "SUPPORTED_ARCHITECTURES",
    "All2AllPrepareAndFinalize",
    "CompletedHandle",
    "CpuPlatform",
    "CudaPlatform",
    "CustomOp",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DenseMLP",
    "FusedMoE",
    "FusedMoEModularKernel",
    "FusedMoEPrepareAndFinalize",
    "LoadStats",
    "MLAAttention",
    "MixtralForCausalLM",
    "MoEForCausalLM",
    "MoEModelConfig",
    "NoEPPrepareAndFinalize",
    "OlmoeForCausalLM",
    "PagedAttention",
    "PagedMLACache",
    "Platform",
    "Qwen2MoeForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "RoutingConfig",
    "RoutingResult",
    "SiluAndMul",
    "TorchExperts",
    "build_model",
    "check_checkpoint",
    "checkpoint_targets",
    "current_platform",
    "get_custom_ops",
    "init_random_weights",
    "load_checkpoint",
    "load_config",
    "make_prepare_finalize",
    "paged_attention",
    "parameter_bytes",
    "parse_custom_ops",
    "rotate_half",
    "select_experts",
    "set_custom_ops",
    "swiglu",
    "write_kv_cache",
]
