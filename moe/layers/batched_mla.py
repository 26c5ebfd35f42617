"""MLA of all requests of a (u)batch at once over the paged latent cache (``moe.layers.mla``).

Requests with at most ``absorb_max_query_len`` query rows take the absorbed form (attention over
the latents themselves), the others the expanded one (per-head K/V through ``kv_b_proj``), as
the per-request reference decides. On the CPU our compiled paged kernel runs both
(``moe.kernels``: the absorbed requests over the latent rows in place, in the multi-query form;
each chunk of expanded ones over its expanded K/V); elsewhere the requests are padded in chunks
(``moe.layers.batched_attention.request_chunks``) and attend through
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.layers.batched_attention import (
    PaddedRequests,
    gather_context,
    gather_rows,
    kernel_inputs,
    paged_attention_kernel,
    plan_key,
    request_chunks,
)

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata


def batched_mla_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_b_weight: Tensor,
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    kv_lora_rank: int,
    scale: float,
    absorb_max_query_len: int,
    expand: Callable[[Tensor], Tensor] | None = None,
    expanded_cut: float = math.inf,
    use_kernel: bool = True,
) -> Tensor:
    """MLA of every query row over its request's cached latents, absorbed for requests with at
    most ``absorb_max_query_len`` query rows and expanded for the others (module docstring).

    Args:
        q_nope: [num_tokens, num_heads, nope]; q_pe: [num_tokens, num_heads, rope] (rotated).
        kv_b_weight: [num_heads * (nope + v), kv_lora_rank] (``kv_b_proj.weight``).
        kv_cache: [num_blocks, block_size, kv_lora_rank + rope].
        expand: ``kv_b_proj`` as a function of latents [..., kv_lora_rank] (the layer's
            ``Linear``, packed on the CPU); default ``F.linear`` with ``kv_b_weight``.
        use_kernel, expanded_cut: our CPU kernel where it applies (False: TORCH_SDPA, every chunk
            in SDPA), expanded chunks longer than the cut in SDPA (``mla_expanded_cut``; none).

    Returns:
        [num_tokens, num_heads, v] in q_nope's dtype; rows of no request are zero.
    """
    num_tokens, num_heads, nope = q_nope.shape
    w_kv = kv_b_weight.view(num_heads, -1, kv_lora_rank)  # [H, nope + v, r]
    v_dim = w_kv.shape[1] - nope
    expand = functools.partial(F.linear, weight=kv_b_weight) if expand is None else expand
    out = q_nope.new_zeros(num_tokens + 1, num_heads, v_dim)  # last row: scratch for padding
    block_size, context_bytes = kv_cache.shape[1], kv_cache.shape[2] * kv_cache.element_size()
    chunks = request_chunks(
        attn_metadata,
        block_size,
        short_query_len=absorb_max_query_len,
        context_bytes_per_token=context_bytes,
        data_device=q_nope.device,
    )
    padded = chunks  # through SDPA
    if use_kernel and (kernel := paged_attention_kernel(q_nope, kv_cache)) is not None:
        query, short = (q_nope, q_pe), _short_requests(attn_metadata, absorb_max_query_len)
        _mla_absorbed_kernel(kernel, out, query, w_kv, kv_cache, short, scale=scale)
        long_chunks = [c for c in chunks if c.max_query_len > absorb_max_query_len]
        padded = [c for c in long_chunks if c.max_query_len > expanded_cut]
        plan = plan_key(block_size, absorb_max_query_len, context_bytes, q_nope.device)
        kept = [c for c in long_chunks if c.max_query_len <= expanded_cut]
        expanded = (kept, (plan, expanded_cut))
        _mla_expanded_kernel(
            kernel, out[:num_tokens], query, kv_cache, expanded, attn_metadata, expand, scale=scale
        )
    for chunk in padded:
        o = _mla_padded_chunk(
            (q_nope, q_pe), kv_cache, chunk, w_kv, expand, absorb_max_query_len, scale=scale
        )
        out.index_copy_(0, chunk.scatter_rows.flatten(), o.transpose(1, 2).flatten(0, 1))
    return out[:num_tokens]


def _mla_padded_chunk(
    query: tuple[Tensor, Tensor],
    kv_cache: Tensor,
    chunk: PaddedRequests,
    w_kv: Tensor,
    expand: Callable[[Tensor], Tensor],
    absorb_max_query_len: int,
    *,
    scale: float,
) -> Tensor:
    """One padded chunk's MLA through SDPA, absorbed or expanded by its longest query:
    query (q_nope [T, H, nope], q_pe [T, H, rope]), kv_cache [num_blocks, block_size,
    kv_lora_rank + rope] (the chunk's latents are gathered from it), w_kv [H, nope + v,
    kv_lora_rank] -> [R, H, Q, v]."""
    q_nope, q_pe = query
    rows = gather_context(kv_cache, chunk).to(q_nope.dtype)  # [R, S, r + rope]
    nope, kv_lora_rank = q_nope.shape[-1], w_kv.shape[-1]
    qn = gather_rows(q_nope, chunk).transpose(1, 2)  # [R, H, Q, nope]
    qp = gather_rows(q_pe, chunk).transpose(1, 2)  # [R, H, Q, rope]
    mask = chunk.attn_mask[:, None]  # [R, 1, Q, S]
    if chunk.max_query_len <= absorb_max_query_len:
        return _mla_absorbed(qn, qp, rows, mask, w_kv[:, :nope], w_kv[:, nope:], scale=scale)
    return _mla_expanded(qn, qp, rows, mask, expand, kv_lora_rank=kv_lora_rank, scale=scale)


@dataclass(frozen=True, slots=True)
class _ShortRequests:
    """The requests with 1 to ``short_query_len`` query rows, as a compact batch of their own.

    Fields: ``rows`` [n] int64, their flat query rows in order; ``block_table`` [R, max_blocks],
    ``seq_lens`` [R] and ``query_start_loc`` [R + 1] int32 over the compact rows; ``req_ids`` [R]
    int64 (0 .. R - 1).
    """

    rows: Tensor
    block_table: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    req_ids: Tensor


def _short_requests(attn_metadata: CommonAttentionMetadata, short_query_len: int) -> _ShortRequests:
    """``_ShortRequests`` of this (u)batch, built once and shared by its layers."""

    def build() -> _ShortRequests:
        qsl = attn_metadata.query_start_loc.long()
        query_lens = qsl[1:] - qsl[:-1]
        req_ids = ((query_lens > 0) & (query_lens <= short_query_len)).nonzero().flatten()
        lens = query_lens[req_ids]
        compact_qsl = torch.zeros(len(req_ids) + 1, dtype=torch.long, device=qsl.device)
        torch.cumsum(lens, 0, out=compact_qsl[1:])
        first_rows = (qsl[req_ids] - compact_qsl[:-1]).repeat_interleave(lens)
        return _ShortRequests(
            rows=first_rows + torch.arange(len(first_rows), device=qsl.device),
            block_table=attn_metadata.block_table[req_ids].contiguous(),
            seq_lens=attn_metadata.seq_lens[req_ids].contiguous(),
            query_start_loc=compact_qsl.int(),
            req_ids=torch.arange(len(req_ids), device=qsl.device),
        )

    return attn_metadata.derived(("short_requests", short_query_len), build)


def _mla_absorbed_kernel(
    kernel: Callable[..., None],
    out: Tensor,
    query: tuple[Tensor, Tensor],
    w_kv: Tensor,
    kv_cache: Tensor,
    short: _ShortRequests,
    *,
    scale: float,
) -> None:
    """``_mla_absorbed`` of the ``short`` requests in one call of our compiled paged kernel,
    which reads the latents in place: one KV head whose keys are the cache rows ``[kv_c, k_pe]``
    and whose values are their first ``kv_lora_rank`` elements (the multi-query form). Writes
    those requests' rows of ``out`` [T + 1, H, v].

    Args: query (q_nope [T, H, nope], q_pe [T, H, rope]), w_kv [H, nope + v, r] (``W_UK`` then
    ``W_UV`` per head), kv_cache [num_blocks, block_size, r + rope] (contiguous, q_nope's dtype).
    """
    q_nope, q_pe = query
    if not short.rows.numel():
        return
    nope = q_nope.shape[-1]
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    kv_lora_rank = w_uk.shape[-1]
    # W_UK folded into the query: one bmm per head over the rows, [H, n, nope] @ [H, nope, r]
    q_lat = torch.bmm(q_nope.index_select(0, short.rows).transpose(0, 1), w_uk)
    q = torch.cat((q_lat.transpose(0, 1), q_pe.index_select(0, short.rows)), dim=-1)
    o_lat = q.new_empty(*q.shape[:2], kv_lora_rank)  # [n, H, r]
    latents = kv_cache[:, :, None]  # [num_blocks, block_size, 1, r + rope]
    kernel(
        o_lat,
        q,
        latents,
        latents[..., :kv_lora_rank],
        short.block_table,
        short.seq_lens,
        short.query_start_loc,
        short.req_ids,
        scale,
    )
    o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2))  # [H, n, v]
    out.index_copy_(0, short.rows, o.transpose(0, 1))


def _mla_absorbed(
    qn: Tensor, qp: Tensor, rows: Tensor, mask: Tensor, w_uk: Tensor, w_uv: Tensor, *, scale: float
) -> Tensor:
    """One chunk's MLA with ``W_UK`` absorbed into the query and ``W_UV`` applied after: attention
    over the latents themselves (keys ``[c_kv, k_pe]``, values ``c_kv``), as the reference's decode.

    Args:
        qn: [R, H, Q, nope]; qp: [R, H, Q, rope]; rows: [R, S, kv_lora_rank + rope] latents;
        mask: [R, 1, Q, S]; w_uk: [H, nope, kv_lora_rank]; w_uv: [H, v, kv_lora_rank].

    Returns:
        [R, H, Q, v].
    """
    num_reqs, num_heads, q_len, nope = qn.shape
    kv_lora_rank = w_uk.shape[-1]
    # one bmm per head over all requests' rows ([H, R*Q, nope] @ [H, nope, r]): a broadcast
    # matmul against [H, nope, r] would copy the weights once per request
    q_lat = torch.bmm(qn.transpose(0, 1).reshape(num_heads, -1, nope), w_uk)
    q_lat = q_lat.view(num_heads, num_reqs, q_len, kv_lora_rank).permute(1, 2, 0, 3)
    # Every head attends over the same latents (multi-query form, as FlashMLA): the heads become
    # query rows of one head, [R, 1, Q*H, r + rope] in (query, head) order, so K and V are read
    # once per request instead of once per head.
    q = torch.cat((q_lat, qp.transpose(1, 2)), dim=-1)  # [R, Q, H, r + rope]
    q = q.reshape(num_reqs, 1, q_len * num_heads, q.shape[-1])
    if q_len > 1:
        mask = mask.repeat_interleave(num_heads, dim=2)  # [R, 1, Q*H, S]
    o_lat = F.scaled_dot_product_attention(
        q, rows[:, None], rows[:, None, :, :kv_lora_rank], attn_mask=mask, scale=scale
    )  # [R, 1, Q*H, r]
    o_lat = o_lat.view(num_reqs, q_len, num_heads, kv_lora_rank).permute(2, 0, 1, 3)
    out = torch.bmm(o_lat.reshape(num_heads, -1, kv_lora_rank), w_uv.transpose(1, 2))
    return out.view(num_heads, num_reqs, q_len, -1).transpose(0, 1)  # [R, H, Q, v]


def _mla_expand(
    rows: Tensor,
    expand: Callable[[Tensor], Tensor],
    num_heads: int,
    *,
    nope: int,
    kv_lora_rank: int,
) -> tuple[Tensor, Tensor]:
    """The latents ``rows`` [R, S, kv_lora_rank + rope] expanded through ``kv_b_proj``
    (``expand``: [N, kv_lora_rank] -> [N, H * (nope + v)]) to per-head keys ``[k_nope, k_pe]``
    [R, S, H, nope + rope] (contiguous) and values [R, S, H, v] (a view)."""
    num_reqs, s_len, width = rows.shape
    rope = width - kv_lora_rank
    kv = expand(rows[..., :kv_lora_rank].reshape(-1, kv_lora_rank))
    kv = kv.view(num_reqs, s_len, num_heads, -1)
    k_pe = rows[..., None, kv_lora_rank:].expand(num_reqs, s_len, num_heads, rope)
    return torch.cat((kv[..., :nope], k_pe), dim=-1), kv[..., nope:]


def _mla_expanded_kernel(
    kernel: Callable[..., None],
    out: Tensor,
    query: tuple[Tensor, Tensor],
    kv_cache: Tensor,
    chunks: tuple[list[PaddedRequests], tuple],
    attn_metadata: CommonAttentionMetadata,
    expand: Callable[[Tensor], Tensor],
    *,
    scale: float,
) -> None:
    """MLA of the expanded requests' chunks in our compiled kernel: per chunk the latents are
    gathered and expanded (``_mla_expand``) and each request attends over its own expanded keys
    and values as one block of ``max_seq_len`` slots (no padding is attended).

    Args: out [T, H, v] (the chunks' rows are written), query (q_nope [T, H, nope], q_pe
    [T, H, rope]), kv_cache [num_blocks, block_size, kv_lora_rank + rope], chunks (the
    expanded requests' chunks of a padding plan, and a key naming them: that plan's ``plan_key``
    with the cut that chose them), expand (``kv_b_proj``).
    """
    chunks, chunks_key = chunks
    if not chunks:
        return
    q_nope, q_pe = query
    q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, nope + rope]
    num_heads, nope = q_nope.shape[1:]
    kv_lora_rank = kv_cache.shape[-1] - q_pe.shape[-1]
    _, seq_lens, query_start_loc, _ = kernel_inputs(attn_metadata)
    block_tables = attn_metadata.derived(  # built by the first layer, as the plan is
        ("mla_expanded_block_tables", chunks_key),
        lambda: [_one_block_per_request(chunk, len(seq_lens)) for chunk in chunks],
    )
    for chunk, block_table in zip(chunks, block_tables, strict=True):
        rows = gather_context(kv_cache, chunk).to(q_nope.dtype)
        k, v = _mla_expand(rows, expand, num_heads, nope=nope, kv_lora_rank=kv_lora_rank)
        kernel(out, q, k, v, block_table, seq_lens, query_start_loc, chunk.req_ids, scale)


def _one_block_per_request(chunk: PaddedRequests, num_reqs: int) -> Tensor:
    """int32 ``[num_reqs, 1]`` block table in which request ``chunk.req_ids[i]``'s context is
    block ``i`` (of the chunk's expanded keys and values); other rows 0 (never read)."""
    block_table = torch.zeros(num_reqs, 1, dtype=torch.int32, device=chunk.req_ids.device)
    block_table[chunk.req_ids, 0] = torch.arange(
        chunk.num_reqs, dtype=torch.int32, device=chunk.req_ids.device
    )
    return block_table


def _mla_expanded(
    qn: Tensor,
    qp: Tensor,
    rows: Tensor,
    mask: Tensor,
    expand: Callable[[Tensor], Tensor],
    *,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """One chunk's MLA with the latents expanded to per-head K and V through ``kv_b_proj``, as
    the reference's prefill.

    Args:
        qn: [R, H, Q, nope]; qp: [R, H, Q, rope]; rows: [R, S, kv_lora_rank + rope] latents;
        mask: [R, 1, Q, S]; expand: ``kv_b_proj``, [N, kv_lora_rank] -> [N, H * (nope + v)].

    Returns:
        [R, H, Q, v].
    """
    k, v = _mla_expand(rows, expand, qn.shape[1], nope=qn.shape[-1], kv_lora_rank=kv_lora_rank)
    return F.scaled_dot_product_attention(
        torch.cat((qn, qp), dim=-1),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
