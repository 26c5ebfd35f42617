"""Decoder-only MoE models (Mixtral, DeepSeek-V2/V3, Qwen2-MoE, OLMoE) for DP attention + EP:
one generic stack (``MoEModel``, ``DecoderLayer``) configured by ``MoEModelConfig`` and its
architecture's spec. Layers and parameter names: docs/models.md, "The decoder stack"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dbo.timeline.recorder import set_timeline_layer, timeline_span
from distributed import FusedMoEPrepareAndFinalize
from moe.fused_moe.layer import FusedMoE
from moe.fused_moe.router import RoutingConfig
from moe.layers.attention import GQAAttention
from moe.layers.mla import MLAAttention
from moe.layers.mlp import DenseMLP
from moe.layers.norm import RMSNorm
from moe.models.config import MoEModelConfig

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata


def routing_config(config: MoEModelConfig) -> RoutingConfig:
    """The router's settings from the model config."""
    return RoutingConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        scoring_func=config.scoring_func,
        topk_method=config.topk_method,
        num_expert_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        has_score_correction_bias=config.topk_method == "noaux_tc",
    )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: MoEModelConfig,
        layer_idx: int,
        *,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        ep_rank: int,
        ep_size: int,
        dtype: torch.dtype | None,
        device=None,
    ):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        spec = config.spec
        attention_cls = MLAAttention if spec.attention == "mla" else GQAAttention
        self.self_attn = attention_cls(config, **kw)
        self.mlp_name = spec.moe_block
        if config.moe_layers[layer_idx]:
            mlp = FusedMoE(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size,
                num_experts=config.num_experts,
                prepare_finalize=prepare_finalize,
                ep_rank=ep_rank,
                ep_size=ep_size,
                routing=routing_config(config),
                fp32_router=spec.router_dtype == "float32",
                expert_checkpoint_names=dict(spec.expert_names),
                shared_intermediate_size=config.shared_intermediate_size,
                shared_expert_name=spec.shared_experts or "shared_experts",
                has_shared_expert_gate=config.has_shared_expert_gate,
                **kw,
            )
        else:
            self.mlp_name = "mlp"
            mlp = DenseMLP(config.hidden_size, config.intermediate_size, **kw)
        setattr(self, self.mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(
        self, positions: Tensor, hidden_states: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        with timeline_span("attention"):
            residual = hidden_states
            hidden_states = self.self_attn(
                positions, self.input_layernorm(hidden_states), attn_metadata
            )
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + getattr(self, self.mlp_name)(hidden_states)


class MoEModel(nn.Module):
    def __init__(self, config: MoEModelConfig, **layer_kw):
        super().__init__()
        dtype, device = layer_kw["dtype"], layer_kw.get("device")
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, **layer_kw) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self, input_ids: Tensor, positions: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer_idx, layer in enumerate(self.layers):
            set_timeline_layer(layer_idx)  # names this thread's spans layer{i}.attention, ...
            hidden_states = layer(positions, hidden_states, attn_metadata)
        set_timeline_layer(None)
        return self.norm(hidden_states)
