"""moe: model side — config, router, modular fused-MoE kernel, experts, attention, models, loading."""

from moe.attention import PagedAttention, paged_attention, write_kv_cache
from moe.build import MODEL_REGISTRY, build_model, make_prepare_finalize
from moe.config import SUPPORTED_ARCHITECTURES, MoEModelConfig
from moe.experts import TorchExperts
from moe.fused_moe import FusedMoE
from moe.layers import RMSNorm, RotaryEmbedding, rotate_half, swiglu
from moe.loader import (
    LoadStats,
    check_checkpoint,
    checkpoint_targets,
    init_random_weights,
    load_checkpoint,
    load_config,
)
from moe.mixtral import MixtralForCausalLM
from moe.modular_kernel import (
    All2AllPrepareAndFinalize,
    CompletedHandle,
    FusedMoEModularKernel,
    FusedMoEPrepareAndFinalize,
    NoEPPrepareAndFinalize,
)
from moe.router import RoutingResult, select_experts

__all__ = [
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "All2AllPrepareAndFinalize",
    "CompletedHandle",
    "FusedMoE",
    "FusedMoEModularKernel",
    "FusedMoEPrepareAndFinalize",
    "LoadStats",
    "MixtralForCausalLM",
    "MoEModelConfig",
    "NoEPPrepareAndFinalize",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "RoutingResult",
    "TorchExperts",
    "build_model",
    "check_checkpoint",
    "checkpoint_targets",
    "init_random_weights",
    "load_checkpoint",
    "load_config",
    "make_prepare_finalize",
    "paged_attention",
    "rotate_half",
    "select_experts",
    "swiglu",
    "write_kv_cache",
]
