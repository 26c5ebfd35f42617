"""moe: model side — config, router, modular fused-MoE kernel, experts, attention, models,
loading."""

from distributed import FusedMoEPrepareAndFinalize, NoEPPrepareAndFinalize
from moe.fused_moe.experts import TorchExperts
from moe.fused_moe.layer import FusedMoE
from moe.fused_moe.modular_kernel import FusedMoEModularKernel
from moe.fused_moe.router import Router, RoutingConfig, RoutingResult, select_experts
from moe.layers.activation import SiluAndMul, swiglu
from moe.layers.attention import PagedAttention, paged_attention, write_kv_cache
from moe.layers.attention_metadata import CommonAttentionMetadata, split_attn_metadata
from moe.layers.mla import MLAAttention, PagedMLACache
from moe.layers.mlp import DenseMLP
from moe.layers.norm import RMSNorm
from moe.layers.rotary import RotaryEmbedding, rotate_half
from moe.model_loader.loader import (
    LoadStats,
    check_checkpoint,
    checkpoint_targets,
    init_random_weights,
    load_checkpoint,
    load_config,
)
from moe.models.architectures import ARCHITECTURES, supported_architectures
from moe.models.causal_lm import PARAM_CATEGORIES, MoEForCausalLM, parameter_bytes
from moe.models.config import MoEModelConfig
from moe.models.registry import build_model, config_parameter_bytes
from moe.models.spec import ArchitectureSpec
from moe.platforms.custom_op import CustomOp, get_custom_ops, parse_custom_ops, set_custom_ops
from moe.platforms.interface import CpuPlatform, CudaPlatform, Platform
from moe.platforms.plugins import current_platform

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "PARAM_CATEGORIES",
    "CommonAttentionMetadata",
    "CpuPlatform",
    "CudaPlatform",
    "CustomOp",
    "DenseMLP",
    "FusedMoE",
    "FusedMoEModularKernel",
    "FusedMoEPrepareAndFinalize",
    "LoadStats",
    "MLAAttention",
    "MoEForCausalLM",
    "MoEModelConfig",
    "NoEPPrepareAndFinalize",
    "PagedAttention",
    "PagedMLACache",
    "Platform",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "RoutingConfig",
    "RoutingResult",
    "SiluAndMul",
    "TorchExperts",
    "build_model",
    "config_parameter_bytes",
    "check_checkpoint",
    "checkpoint_targets",
    "current_platform",
    "get_custom_ops",
    "init_random_weights",
    "load_checkpoint",
    "load_config",
    "paged_attention",
    "parameter_bytes",
    "parse_custom_ops",
    "rotate_half",
    "select_experts",
    "split_attn_metadata",
    "supported_architectures",
    "set_custom_ops",
    "swiglu",
    "write_kv_cache",
]
