"""Mixtral (decoder-only, GQA attention, top-2 sparse MoE) for DP attention + expert parallelism.

Module and parameter names follow the HF checkpoint (``model.layers.{i}.self_attn.q_proj``,
``block_sparse_moe.gate`` …) so the loader maps names one to one, except the experts, which are
stacked per rank (``block_sparse_moe.experts.w1`` [num_local_experts, F, H] ← checkpoint
``block_sparse_moe.experts.{e}.w1.weight``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dbo.timeline import set_timeline_layer, timeline_span
from moe.attention import PagedAttention
from moe.config import MoEModelConfig
from moe.fused_moe import FusedMoE
from moe.layers import RMSNorm, RotaryEmbedding
from moe.modular_kernel import FusedMoEPrepareAndFinalize

if TYPE_CHECKING:
    from dbo.attention_metadata import CommonAttentionMetadata


class MixtralAttention(nn.Module):
    def __init__(self, config: MoEModelConfig, *, dtype: torch.dtype | None, device=None):
        super().__init__()
        h, nh, nkv, hd = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(h, nh * hd, **kw)
        self.k_proj = nn.Linear(h, nkv * hd, **kw)
        self.v_proj = nn.Linear(h, nkv * hd, **kw)
        self.o_proj = nn.Linear(nh * hd, h, **kw)
        self.rotary_emb = RotaryEmbedding(hd, config.rope_theta, device=device)
        self.attn = PagedAttention(num_heads=nh, num_kv_heads=nkv, head_dim=hd, scale=hd**-0.5)

    def forward(
        self, positions: Tensor, hidden_states: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        num_tokens = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(num_tokens, self.attn.num_heads, self.attn.head_dim)
        k = self.k_proj(hidden_states).view(num_tokens, self.attn.num_kv_heads, self.attn.head_dim)
        v = self.v_proj(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, attn_metadata)
        return self.o_proj(out)


class MixtralDecoderLayer(nn.Module):
    def __init__(
        self,
        config: MoEModelConfig,
        *,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        ep_rank: int,
        ep_size: int,
        dtype: torch.dtype | None,
        device=None,
    ):
        super().__init__()
        self.self_attn = MixtralAttention(config, dtype=dtype, device=device)
        self.block_sparse_moe = FusedMoE(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            prepare_finalize=prepare_finalize,
            ep_rank=ep_rank,
            ep_size=ep_size,
            dtype=dtype,
            device=device,
        )
        norm_kw = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm_kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm_kw)

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
        return residual + self.block_sparse_moe(hidden_states)


class MixtralModel(nn.Module):
    def __init__(self, config: MoEModelConfig, **layer_kw):
        super().__init__()
        dtype, device = layer_kw["dtype"], layer_kw.get("device")
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            MixtralDecoderLayer(config, **layer_kw) for _ in range(config.num_hidden_layers)
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


class MixtralForCausalLM(nn.Module):
    """Mixtral for one DP/EP rank: full attention + router, only this rank's experts.

    Args:
        config: model shape.
        prepare_finalize: dispatch/combine strategy shared by all MoE layers
            (``NoEPPrepareAndFinalize`` when ep_size == 1, ``All2AllPrepareAndFinalize`` otherwise).
        ep_rank, ep_size: this rank's place in the EP group; it holds global experts
            ``[ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size)``.
        dtype: parameter / activation dtype (float32 or bfloat16); device: where parameters live.

    Weights are uninitialised (``torch.empty``): call ``moe.load_checkpoint`` or
    ``moe.init_random_weights`` next.
    """

    def __init__(
        self,
        config: MoEModelConfig,
        *,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        ep_rank: int = 0,
        ep_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.config = config
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.dtype = dtype
        self.model = MixtralModel(
            config,
            prepare_finalize=prepare_finalize,
            ep_rank=ep_rank,
            ep_size=ep_size,
            dtype=dtype,
            device=device,
        )
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # no_grad, not inference_mode: with DBO a combine started here may be completed by a recv hook
    # that runs after this call returns (outside inference mode), and in-place ops on inference
    # tensors are illegal there.
    @torch.no_grad()
    def forward(
        self, input_ids: Tensor, positions: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden_states [num_tokens, hidden_size].

        Rows past ``attn_metadata.num_actual_tokens`` are padding (computed, never cached)."""
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                f"must both be [num_tokens]"
            )
        if input_ids.shape[0] != attn_metadata.num_tokens:
            raise ValueError(
                f"got {input_ids.shape[0]} tokens but attn_metadata.num_tokens="
                f"{attn_metadata.num_tokens}"
            )
        return self.model(input_ids, positions, attn_metadata)

    @torch.no_grad()
    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """hidden_states [num_tokens, hidden_size] -> logits [num_tokens, vocab_size] float32."""
        return self.lm_head(hidden_states).float()

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Per-layer cache shape ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        c = self.config
        return (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)

    def allocate_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[Tensor]:
        """Allocate zeroed caches, one per layer, AND bind them (``bind_kv_caches``); returns them.

        dtype defaults to the model's, device to the parameters'.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        if device is None:
            device = self.lm_head.weight.device
        shape = self.kv_cache_shape(num_blocks, block_size)
        kv_caches = [
            torch.zeros(shape, dtype=dtype or self.dtype, device=device)
            for _ in range(self.config.num_hidden_layers)
        ]
        self.bind_kv_caches(kv_caches)
        return kv_caches

    def bind_kv_caches(self, kv_caches: list[Tensor]) -> None:
        """Attach one cache per layer (in layer order); ValueError on a wrong count or shape."""
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(
                f"expected {len(layers)} KV caches (one per layer), got {len(kv_caches)}"
            )
        for attn, cache in zip(layers, kv_caches, strict=True):
            attn.bind_kv_cache(cache)
