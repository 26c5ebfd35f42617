"""Paged KV-cache attention: the cache write (``write_kv_cache``), the per-request plain-torch
reference (``paged_attention``) and the attention ops (``PagedAttention``, ``GQAAttention``). The
cache layout and the causal rule: docs/models.md, "Paged KV cache layout"."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.compilation.splitting import splitting_op
from moe.layers import triton_attention
from moe.layers.attention_backend import AttentionBackendEnum
from moe.layers.attention_selector import selected_attention_backend
from moe.layers.attention_tuning import kernel_cut
from moe.layers.batched_attention import (
    KERNEL_EVERYWHERE,
    SDPA_EVERYWHERE,
    batched_paged_attention,
)
from moe.layers.flex_attention import flex_paged_attention
from moe.layers.linear import Linear
from moe.layers.norm import RMSNorm
from moe.layers.rotary import RotaryEmbedding
from moe.layers.triton_attention import triton_paged_attention, triton_write_kv_cache
from moe.platforms.custom_op import CustomOp

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata
    from moe.models.config import MoEModelConfig


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at ``slot_mapping`` [num_tokens]
    (int64, -1 = padding, skipped) into ``kv_cache``
    [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    # slot = block_id * block_size + offset is exactly the row index of the flattened cache
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_blocks * block_size, kvh, hd]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    if slots.numel() == 0:
        return
    flat[0, slots] = key[valid].to(kv_cache.dtype)
    flat[1, slots] = value[valid].to(kv_cache.dtype)


def kv_write_slots(
    attn_metadata: CommonAttentionMetadata, device: torch.device
) -> tuple[Tensor | None, Tensor]:
    """(rows, slots) of this (u)batch's KV write: ``slots`` [n] int64 cache slots of the real rows
    that have one, ``rows`` [n] int64 their indices among the first ``num_actual_tokens`` rows, or
    None when every real row has a slot (the engine's case). Built once per (u)batch
    (``attn_metadata.derived``) and shared by every layer."""

    def build() -> tuple[Tensor | None, Tensor]:
        # decided where the metadata lives (the engine's: the host, so no device sync), then
        # copied to the cache's device
        slot_mapping = attn_metadata.slot_mapping[: attn_metadata.num_actual_tokens]
        valid = slot_mapping >= 0
        if bool(valid.all()):  # reads values once per (u)batch: free for host metadata
            return None, slot_mapping.long().to(device)
        rows = valid.nonzero().flatten()
        return rows.to(device), slot_mapping[rows].long().to(device)

    return attn_metadata.derived(("kv_write_slots", device), build)


def write_kv_cache_planned(
    key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata: CommonAttentionMetadata
) -> None:
    """``write_kv_cache`` of the real rows of key/value [num_tokens, num_kv_heads, head_dim] at
    ``attn_metadata.slot_mapping``, with the slots computed once per (u)batch."""
    rows, slots = kv_write_slots(attn_metadata, kv_cache.device)
    if slots.numel() == 0:
        return
    num_actual = attn_metadata.num_actual_tokens
    key, value = key[:num_actual], value[:num_actual]
    if rows is not None:
        key, value = key[rows], value[rows]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_blocks * block_size, kvh, hd]
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """One request's share of a step, as the per-request attention loops need it."""

    q_start: int  # first query row of the request in the flat batch
    q_end: int  # one past its last query row
    seq_len: int  # context length including this step's query tokens
    blocks: Tensor  # [ceil(seq_len / block_size)] int64 KV cache block ids, in order
    causal_mask: Tensor  # [q_end - q_start, seq_len] bool, True = attend


def iter_request_spans(
    attn_metadata: CommonAttentionMetadata, block_size: int, device: torch.device
) -> Iterator[RequestSpan]:
    """The requests of ``attn_metadata`` that have query rows, with their blocks and causal mask
    (query positions are ``seq_len - q_len .. seq_len - 1``)."""
    # blocking host sync: request boundaries drive the per-request loop
    query_start_loc = attn_metadata.query_start_loc.tolist()
    seq_lens = attn_metadata.seq_lens.tolist()
    for i in range(attn_metadata.num_reqs):
        q_start, q_end = query_start_loc[i], query_start_loc[i + 1]
        q_len, seq_len = q_end - q_start, seq_lens[i]
        if q_len == 0:
            continue
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        yield RequestSpan(
            q_start=q_start,
            q_end=q_end,
            seq_len=seq_len,
            blocks=attn_metadata.block_table[i, : -(-seq_len // block_size)].long(),
            causal_mask=torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None],
        )


def paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    scale: float,
) -> Tensor:
    """Write this step's K/V into the cache, then attend over each request's cached context.

    Args:
        query: [num_tokens, num_heads, head_dim]
        key, value: [num_tokens, num_kv_heads, head_dim] (already rotated)
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: query_start_loc / seq_lens / block_table / slot_mapping of this (u)batch.
        scale: softmax scale (head_dim ** -0.5).

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype; padding rows are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[3:] != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_actual = attn_metadata.num_actual_tokens
    write_kv_cache(
        key[:num_actual], value[:num_actual], kv_cache, attn_metadata.slot_mapping[:num_actual]
    )
    out = torch.zeros_like(query)
    block_size = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    for span in iter_request_spans(attn_metadata, block_size, query.device):
        seq_len = span.seq_len
        k = kv_cache[0, span.blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(query.dtype)
        v = kv_cache[1, span.blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(query.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(
            query[span.q_start : span.q_end].transpose(0, 1),  # [num_heads, q_len, head_dim]
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=span.causal_mask,
            scale=scale,
        )
        out[span.q_start : span.q_end] = o.transpose(0, 1)
    return out


@CustomOp.register("paged_attention")
class PagedAttention(CustomOp):
    """Attention core of one layer; its cache is attached by ``bind_kv_cache``.

    forward(query [T, num_heads*head_dim], key/value [T, num_kv_heads*head_dim], attn_metadata)
    -> [T, num_heads*head_dim]: writes the real rows' K/V, then attends. ``forward_native`` is the
    per-request reference (``paged_attention``); ``forward_cpu`` / ``forward_cuda`` run all
    requests at once with the attention backend selected when the op is built
    (``moe.layers.attention_backend``): ``batched_paged_attention`` (CPU_ATTN: our kernel up to
    the measured cut; TORCH_SDPA: padded SDPA chunks), ``flex_paged_attention`` or, on CUDA,
    ``triton_paged_attention`` (TRITON_ATTN).
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: Tensor | None = None  # not a buffer: the engine owns and sizes it
        self.backend = selected_attention_backend()
        # where batched_paged_attention leaves our CPU kernel for SDPA (set with the cache)
        self.kernel_cut = KERNEL_EVERYWHERE

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K and V of every token)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def bind_kv_cache(self, kv_cache: Tensor) -> None:
        """kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; ValueError otherwise.
        With CPU_ATTN, looks up (once per machine: measures) where our CPU kernel hands long
        queries to SDPA for this cache (``moe.layers.attention_tuning.kernel_cut``)."""
        if (
            kv_cache.dim() != 5
            or kv_cache.shape[0] != 2
            or tuple(kv_cache.shape[3:]) != (self.num_kv_heads, self.head_dim)
        ):
            raise ValueError(
                "kv_cache must be "
                f"[2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache
        if self.backend is AttentionBackendEnum.CPU_ATTN:
            self.kernel_cut = kernel_cut(kv_cache, self.num_heads)
        elif self.backend is AttentionBackendEnum.TORCH_SDPA:
            self.kernel_cut = SDPA_EVERYWHERE

    def _heads(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call model.bind_kv_caches(...) first")
        num_tokens = query.shape[0]
        return (
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
            value.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def forward_native(
        self, query: Tensor, key: Tensor, value: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        q, k, v = self._heads(query, key, value)
        out = paged_attention(q, k, v, self.kv_cache, attn_metadata, scale=self.scale)
        return out.reshape(query.shape[0], self.num_heads * self.head_dim)

    def _forward_batched(
        self, query: Tensor, key: Tensor, value: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        q, k, v = self._heads(query, key, value)
        write_kv_cache_planned(k, v, self.kv_cache, attn_metadata)
        if self.backend is AttentionBackendEnum.FLEX_ATTENTION:
            out = flex_paged_attention(q, self.kv_cache, attn_metadata, scale=self.scale)
        else:
            out = batched_paged_attention(
                q, self.kv_cache, attn_metadata, scale=self.scale, cut=self.kernel_cut
            )
        return out.reshape(query.shape[0], self.num_heads * self.head_dim)

    def forward_cpu(
        self, query: Tensor, key: Tensor, value: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        return self._forward_batched(query, key, value, attn_metadata)

    def forward_cuda(
        self, query: Tensor, key: Tensor, value: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        if self.backend is AttentionBackendEnum.TRITON_ATTN and triton_attention.launches_on(
            query.device
        ):
            return self._forward_triton(query, key, value, attn_metadata)
        return self._forward_batched(query, key, value, attn_metadata)

    def _forward_triton(
        self, query: Tensor, key: Tensor, value: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        """TRITON_ATTN: the K/V write and the attention, one launch each, reading nothing on the
        host (``moe.layers.triton_attention``)."""
        q, k, v = self._heads(query, key, value)
        triton_write_kv_cache(k, v, self.kv_cache, attn_metadata)
        out = triton_paged_attention(q, self.kv_cache, attn_metadata, scale=self.scale)
        return out.view(query.shape[0], self.num_heads * self.head_dim)


class GQAAttention(nn.Module):
    """Grouped-query attention over a paged K/V cache (Mixtral, Qwen2-MoE, OLMoE).

    Options from the config: biases on q/k/v (``qkv_bias``) and o (``o_bias``); OLMoE's ``q_norm``
    [num_heads*head_dim] / ``k_norm`` [num_kv_heads*head_dim] RMSNorms before RoPE, or Qwen3's
    per head (``qk_norm_per_head``: both [head_dim], over each head), and ``clip_qkv``.
    """

    def __init__(self, config: MoEModelConfig, *, dtype: torch.dtype | None, device=None):
        super().__init__()
        c = config
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kw = {"dtype": dtype, "device": device}
        # q, k and v in one GEMM (vLLM's QKVParallelLinear): the checkpoint's q_proj, k_proj and
        # v_proj load into its row blocks, in that order (``checkpoint_shards``, the loader's)
        self.qkv_sizes = (nh * hd, nkv * hd, nkv * hd)
        self.qkv_proj = Linear(h, sum(self.qkv_sizes), bias=c.qkv_bias, **kw)
        self.checkpoint_shards = {
            "qkv_proj": tuple(zip(("q_proj", "k_proj", "v_proj"), self.qkv_sizes, strict=True))
        }
        self.o_proj = Linear(nh * hd, h, bias=c.o_bias, **kw)
        if c.qk_norm:
            per_head = c.qk_norm_per_head
            self.q_norm = RMSNorm(hd if per_head else nh * hd, c.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(hd if per_head else nkv * hd, c.rms_norm_eps, **kw)
        self.clip_qkv = c.clip_qkv
        self.rotary_emb = RotaryEmbedding(
            hd,
            c.rope_theta,
            scaling=c.rope_scaling_dict,
            max_position_embeddings=c.max_position_embeddings,
            device=device,
        )
        self.attn = PagedAttention(num_heads=nh, num_kv_heads=nkv, head_dim=hd, scale=hd**-0.5)

    def forward(
        self, positions: Tensor, hidden_states: Tensor, attn_metadata: CommonAttentionMetadata
    ) -> Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
        if hasattr(self, "q_norm"):  # over the norm's width: the whole projection or each head
            q = self.q_norm(q.view(num_tokens, -1, self.q_norm.weight.shape[0])).flatten(1)
            k = self.k_norm(k.view(num_tokens, -1, self.k_norm.weight.shape[0])).flatten(1)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, self.attn.num_heads, self.attn.head_dim)
        k = k.view(num_tokens, self.attn.num_kv_heads, self.attn.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = splitting_op(  # the attention core: graph mode keeps it out of its graphs
            self.attn,
            q.reshape(num_tokens, -1),
            k.reshape(num_tokens, -1),
            v,
            out_shape=(self.attn.num_heads * self.attn.head_dim,),
            attn_metadata=attn_metadata,
            span="attention",
        )
        return self.o_proj(out)
