"""DeepSeek multi-head latent attention (MLA; DeepSeek-V2 report §2.1, arXiv:2405.04434) over a
paged cache of compressed latents: ``PagedMLACache`` and ``MLAAttention``. Cache layout and the
expanded / absorbed forms: docs/models.md, "MLA over a latent cache"."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.compilation.splitting import splitting_op
from moe.layers import triton_attention
from moe.layers.attention import iter_request_spans, kv_write_slots
from moe.layers.attention_backend import AttentionBackendEnum
from moe.layers.attention_selector import selected_attention_backend
from moe.layers.attention_tuning import MLALayout, mla_expanded_cut
from moe.layers.batched_mla import batched_mla_attention
from moe.layers.linear import Linear
from moe.layers.norm import RMSNorm
from moe.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from moe.layers.triton_attention import triton_mla_attention, triton_write_mla_cache
from moe.platforms.custom_op import CustomOp

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata
    from moe.models.config import MoEModelConfig

ABSORB_MAX_QUERY_LEN = 4


def _mla_uses_kernel(backend: AttentionBackendEnum) -> bool:
    """Whether MLA's batched paths may use our CPU kernel (CPU_ATTN) or stay in SDPA chunks
    (TORCH_SDPA).

    Raises:
        ValueError: FLEX_ATTENTION, which attends GQA layers only.
    """
    if backend is AttentionBackendEnum.FLEX_ATTENTION:
        raise ValueError(
            "--attention-backend FLEX_ATTENTION attends GQA layers only; this model's MLA layers "
            "run with TORCH_SDPA (or CPU_ATTN on a CPU)"
        )
    return backend is AttentionBackendEnum.CPU_ATTN


@CustomOp.register("mla_attention")
class PagedMLACache(CustomOp):
    """One layer's latent cache (bound by the engine): writes it and attends over it.

    forward(q_nope [T, H, nope], q_pe [T, H, rope], kv_b_weight [H * (nope + v), r],
    attn_metadata, *, scale, expand=None) -> [T, H, v], padding rows zero, with the widths of
    ``layout``. ``expand`` is ``kv_b_proj`` as a function ([N, r] -> [N, H * (nope + v)]: the
    layer's ``Linear``, packed on the CPU), with which the batched paths expand prefill latents.
    ``forward_native`` loops over the requests (the reference); ``forward_cpu`` /
    ``forward_cuda`` run all requests at once (``batched_mla_attention``: our compiled kernel on
    the CPU where it applies, else plain torch; with TRITON_ATTN on CUDA ``triton_mla_attention``,
    every request in the absorbed form, in one launch).
    """

    def __init__(self, layout: MLALayout):
        super().__init__()
        self.layout = layout
        self.kv_cache: Tensor | None = None
        self.backend = selected_attention_backend()
        self.use_kernel = _mla_uses_kernel(self.backend)
        # query rows up to which the expanded requests stay in our CPU kernel, past which they go
        # to SDPA: measured when a cache is bound (mla_expanded_cut)
        self.expanded_cut = math.inf

    @property
    def kv_lora_rank(self) -> int:
        return self.layout.kv_lora_rank

    @property
    def kv_elements_per_token(self) -> int:
        return self.layout.kv_lora_rank + self.layout.rope

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_elements_per_token)

    def bind_kv_cache(self, kv_cache: Tensor) -> None:
        """kv_cache: [num_blocks, block_size, kv_lora_rank + rope]; ValueError else. Looks up
        (once per machine: measures) ``expanded_cut``."""
        if kv_cache.dim() != 3 or kv_cache.shape[2] != self.kv_elements_per_token:
            raise ValueError(
                f"MLA kv_cache must be [num_blocks, block_size, {self.kv_elements_per_token}], "
                f"got {tuple(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache
        if self.use_kernel:
            self.expanded_cut = mla_expanded_cut(kv_cache, self.layout, ABSORB_MAX_QUERY_LEN)

    def write(self, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor) -> None:
        """kv_c [T, r], k_pe [T, rope] at slot_mapping [T] (-1 = padding, skipped)."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call model.bind_kv_caches(...) first")
        flat = self.kv_cache.view(-1, self.kv_elements_per_token)
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        if slots.numel():
            flat[slots] = torch.cat((kv_c[valid], k_pe[valid]), dim=-1).to(flat.dtype)

    def write_planned(
        self, kv_c: Tensor, k_pe: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> None:
        """``write`` of the real rows of kv_c [T, r], k_pe [T, rope] at the metadata's slots,
        which are computed once per (u)batch (``kv_write_slots``): no layer reads the slots.
        TRITON_ATTN writes in one launch that skips slot -1 itself (nothing read on the host)."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call model.bind_kv_caches(...) first")
        if self.backend is AttentionBackendEnum.TRITON_ATTN and triton_attention.launches_on(
            kv_c.device
        ):
            triton_write_mla_cache(kv_c, k_pe, self.kv_cache, attn_metadata)
            return
        rows, slots = kv_write_slots(attn_metadata, self.kv_cache.device)
        if slots.numel() == 0:
            return
        num_actual = attn_metadata.num_actual_tokens
        latents = torch.cat((kv_c[:num_actual], k_pe[:num_actual]), dim=-1)
        if rows is not None:
            latents = latents.index_select(0, rows)
        flat = self.kv_cache.view(-1, self.kv_elements_per_token)
        flat.index_copy_(0, slots, latents.to(flat.dtype))

    def read(self, block_ids: Tensor, seq_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(kv_c [seq_len, r], k_pe [seq_len, rope]) of one request's context."""
        rows = self.kv_cache[block_ids].reshape(-1, self.kv_elements_per_token)[:seq_len].to(dtype)
        return rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :]

    def forward_native(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        kv_b_weight: Tensor,
        attn_metadata: CommonAttentionMetadata,
        *,
        scale: float,
        expand: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        del expand  # the reference expands with the weight itself
        num_tokens, num_heads, nope_dim = q_nope.shape
        w_kv = kv_b_weight.view(num_heads, -1, self.kv_lora_rank)  # [H, nope + v, r]
        w_uk, w_uv = w_kv[:, :nope_dim], w_kv[:, nope_dim:]  # [H, nope, r], [H, v, r]
        v_dim = w_uv.shape[1]
        out = q_nope.new_zeros(num_tokens, num_heads, v_dim)
        block_size = self.kv_cache.shape[1]
        for span in iter_request_spans(attn_metadata, block_size, q_nope.device):
            q_start, q_end, seq_len, mask = span.q_start, span.q_end, span.seq_len, span.causal_mask
            kv_c, k_pe = self.read(span.blocks, seq_len, q_nope.dtype)
            qn, qp = q_nope[q_start:q_end].transpose(0, 1), q_pe[q_start:q_end].transpose(0, 1)
            if q_end - q_start <= ABSORB_MAX_QUERY_LEN:
                q_lat = qn @ w_uk  # [H, q, r]
                k = torch.cat((kv_c, k_pe), dim=-1)[None]  # [1, S, r + rope], shared by all heads
                o_lat = F.scaled_dot_product_attention(
                    torch.cat((q_lat, qp), dim=-1), k, kv_c[None], attn_mask=mask, scale=scale
                )  # [H, q, r]
                o = o_lat @ w_uv.transpose(1, 2)  # [H, q, v]
            else:
                kv = (kv_c @ w_kv.flatten(0, 1).t()).view(seq_len, num_heads, -1)
                k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
                k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)
                o = F.scaled_dot_product_attention(
                    torch.cat((qn, qp), dim=-1),
                    k.transpose(0, 1),
                    v.transpose(0, 1),
                    attn_mask=mask,
                    scale=scale,
                )
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    def _forward_batched(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        kv_b_weight: Tensor,
        attn_metadata: CommonAttentionMetadata,
        *,
        scale: float,
        expand: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        return batched_mla_attention(
            q_nope,
            q_pe,
            kv_b_weight,
            self.kv_cache,
            attn_metadata,
            kv_lora_rank=self.kv_lora_rank,
            scale=scale,
            absorb_max_query_len=ABSORB_MAX_QUERY_LEN,
            expand=expand,
            expanded_cut=self.expanded_cut,
            use_kernel=self.use_kernel,
        )

    def forward_cpu(self, q_nope, q_pe, kv_b_weight, attn_metadata, *, scale, expand=None):
        return self._forward_batched(
            q_nope, q_pe, kv_b_weight, attn_metadata, scale=scale, expand=expand
        )

    def forward_cuda(self, q_nope, q_pe, kv_b_weight, attn_metadata, *, scale, expand=None):
        if self.backend is AttentionBackendEnum.TRITON_ATTN and triton_attention.launches_on(
            q_nope.device
        ):
            return triton_mla_attention(
                q_nope,
                q_pe,
                kv_b_weight,
                self.kv_cache,
                attn_metadata,
                kv_lora_rank=self.kv_lora_rank,
                scale=scale,
            )
        return self._forward_batched(
            q_nope, q_pe, kv_b_weight, attn_metadata, scale=scale, expand=expand
        )


class MLAAttention(nn.Module):
    """MLA for one layer; parameter names follow the HF checkpoint (``q_proj`` or ``q_a_proj`` +
    ``q_a_layernorm`` + ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``).

    forward: positions [T] int64, hidden_states [T, hidden_size] -> [T, hidden_size].
    """

    def __init__(self, config: MoEModelConfig, *, dtype: torch.dtype | None, device=None):
        super().__init__()
        c = config
        lay = self.layout = MLALayout.from_config(c)
        qk_head_dim = lay.nope + lay.rope
        kw = {"dtype": dtype, "device": device}
        h, nh = c.hidden_size, lay.num_heads
        if c.q_lora_rank is None:
            self.q_proj = Linear(h, nh * qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = Linear(h, c.q_lora_rank, bias=c.qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6, **kw)
            self.q_b_proj = Linear(c.q_lora_rank, nh * qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(h, lay.kv_lora_rank + lay.rope, bias=c.qkv_bias, **kw)
        # transformers builds these two norms with the default eps 1e-6, not rms_norm_eps
        self.kv_a_layernorm = RMSNorm(lay.kv_lora_rank, 1e-6, **kw)
        self.kv_b_proj = Linear(lay.kv_lora_rank, nh * (lay.nope + lay.v), bias=False, **kw)
        self.o_proj = Linear(nh * lay.v, h, bias=c.o_bias, **kw)
        self.rotary_emb = RotaryEmbedding(
            lay.rope,
            c.rope_theta,
            is_neox_style=not c.rope_interleave,
            scaling=c.rope_scaling_dict,
            max_position_embeddings=c.max_position_embeddings,
            device=device,
        )
        self.scale = yarn_softmax_scale(c.rope_scaling_dict, qk_head_dim**-0.5)
        self.attn = PagedMLACache(lay)

    def forward(
        self, positions: Tensor, hidden_states: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        num_tokens, lay = hidden_states.shape[0], self.layout
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, lay.num_heads, lay.nope + lay.rope)
        q_nope, q_pe = q.split([lay.nope, lay.rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [lay.kv_lora_rank, lay.rope], dim=-1
        )
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe[:, None, :])
        out = splitting_op(  # the attention core: graph mode keeps it out of its graphs
            self._attend,
            q_nope,
            q_pe,
            kv_c,
            k_pe[:, 0],
            out_shape=(lay.num_heads, lay.v),
            attn_metadata=attn_metadata,
            span="attention",
        )
        return self.o_proj(out.reshape(num_tokens, lay.num_heads * lay.v))

    def _attend(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        kv_c: Tensor,
        k_pe: Tensor,
        attn_metadata: CommonAttentionMetadata,
    ) -> Tensor:
        """The core: write the real rows' latents (kv_c [T, r], k_pe [T, rope]) to the cache,
        then attend (q_nope [T, H, nope], q_pe [T, H, rope]) -> [T, H, v]."""
        self.attn.write_planned(kv_c, k_pe, attn_metadata)
        return self.attn(
            q_nope,
            q_pe,
            self.kv_b_proj.weight,
            attn_metadata,
            scale=self.scale,
            expand=self.kv_b_proj,
        )
