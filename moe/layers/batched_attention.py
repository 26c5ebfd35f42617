"""Paged attention for all requests of a (u)batch at once: no Python loop over requests.

The requests with query rows are put in two groups by query length — short queries (decode rows;
``query_len <= short_query_len``) and the rest (prefill chunks) — so that one long prefill chunk
does not pad every decode row to its length. Each group is sorted by ``seq_len``, split where the
``seq_len`` crosses a quarter-octave bucket (``_chunk_bounds``: no request padded by more than
2^(1/4) in length) and cut into chunks whose gathered context fits ``CHUNK_CONTEXT_BYTES`` (one
chunk for small batches; a loop over chunks, never over requests). A chunk is padded to
``[num_chunk_reqs, max_query_len, ...]`` queries and ``[num_chunk_reqs, max_seq_len, ...]`` keys
gathered through the block table, and attends in one ``scaled_dot_product_attention`` call under a
mask that is both causal and a length mask: query ``i`` of request ``r`` sits at position
``seq_lens[r] - query_lens[r] + i`` and sees key positions ``<=`` its own (so never past
``seq_lens[r]``). The outputs are scattered back to the flat query rows; rows of no request (padding
past ``num_actual_tokens``) stay zero, as in the per-request reference.

Padded query rows (``i >= query_lens[r]``) always see key 0, so no softmax row is empty; their
results are dropped. Masked key slots get weight exactly 0, which relies on every cache slot being
finite: the engine allocates caches zeroed and writes only finite K/V.

The padding plan (chunks, index tensors, masks) depends only on the (u)batch's metadata, so the
first layer builds it and the others reuse it (``CommonAttentionMetadata.derived``).

Host syncs: the chunk sizes and padded lengths are read as Python ints (``.tolist()`` of a few
``[num_reqs]`` tensors) once per (u)batch; free for the CPU metadata the engine builds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.kernels import cpu_kernels
from moe.platforms.custom_op import is_tracing
from moe.platforms.plugins import current_platform

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata


# Each chunk of requests gathers at most this many context bytes (K and V, or MLA latents) into
# one scratch buffer (``_kv_gather``). 1 MiB chunks (the L2 size) kept the copy in L2 but paid a
# call per few requests; with the requests split by seq_len bucket first (``_chunk_bounds``), 16 MiB
# chunks ran decode batches faster and prefills as fast or faster. Without the buckets, large
# chunks pad short prompts to long ones and prefills got slower: both are needed (measurements in
# docs/hardware.md, "Plain-torch attention").
CHUNK_CONTEXT_BYTES = 16 << 20
# Requests go in chunks by seq_len bucket (quarter octaves from 64 tokens up; see _chunk_bounds).
SEQ_LEN_BUCKETS_PER_OCTAVE = 4
SEQ_LEN_BUCKET_MIN = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class PaddedRequests:
    """A chunk of requests padded to ``[num_chunk_reqs, max_query_len]`` query slots.

    Fields:
        req_ids: ``[num_chunk_reqs]`` int64, the chunk's requests (the metadata's numbering).
        gather_rows: ``[num_chunk_reqs, max_query_len]`` int64 flat query row of each slot (0 for
            a padding slot, so gathers stay in range).
        scatter_rows: the same, but ``num_tokens`` (one past the last row) for a padding slot:
            results scattered there land in a scratch row.
        attn_mask: ``[num_chunk_reqs, max_query_len, max_seq_len]`` bool, True = attend.
        blocks: ``[num_chunk_reqs, ceil(max_seq_len / block_size)]`` int64 cache block ids.
        max_query_len, max_seq_len: the padded lengths.
    """

    req_ids: Tensor
    gather_rows: Tensor
    scatter_rows: Tensor
    attn_mask: Tensor
    blocks: Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.gather_rows.shape[0]


def _pad_chunk(
    req_ids: Tensor,
    query_start_loc: Tensor,
    query_lens: Tensor,
    seq_lens: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    data_device: torch.device,
) -> PaddedRequests:
    device = query_start_loc.device
    q_lens, s_lens = query_lens[req_ids], seq_lens[req_ids]
    query_idx = torch.arange(max_query_len, device=device)
    is_query = query_idx[None, :] < q_lens[:, None]
    rows = query_start_loc[req_ids][:, None] + query_idx[None, :]
    q_pos = (s_lens - q_lens)[:, None] + query_idx[None, :]  # [R, Q] position of each query
    key_pos = torch.arange(max_seq_len, device=device)
    num_blocks = -(-max_seq_len // block_size)
    return PaddedRequests(  # built where the metadata lives, used where the data lives
        req_ids=req_ids.to(data_device),
        gather_rows=torch.where(is_query, rows, 0).to(data_device),
        scatter_rows=torch.where(is_query, rows, attn_metadata.num_tokens).to(data_device),
        attn_mask=(key_pos[None, None, :] <= q_pos[:, :, None]).to(data_device),
        blocks=attn_metadata.block_table[req_ids, :num_blocks].long().to(data_device),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )


def _chunk_bounds(
    sorted_seq_lens: list[int], context_bytes_per_token: int
) -> list[tuple[int, int]]:
    """``(start, stop)`` of each chunk of requests sorted by ``seq_len`` (ascending, each >= 1).

    Requests whose ``seq_len`` (at least ``SEQ_LEN_BUCKET_MIN``) lie in different
    ``1 / SEQ_LEN_BUCKETS_PER_OCTAVE``-octave buckets go in different chunks, so no chunk pads a
    request by more than that factor (prefill attention's work grows with the square of the padded
    length); within a bucket, chunks hold at most ``CHUNK_CONTEXT_BYTES`` of gathered context (at
    least one request). A loop over buckets and chunks, never over requests.
    """
    lens = torch.tensor(sorted_seq_lens, dtype=torch.float64).clamp_(min=SEQ_LEN_BUCKET_MIN)
    buckets = lens.log2_().mul_(SEQ_LEN_BUCKETS_PER_OCTAVE).ceil_()
    bounds, start = [], 0
    for count in torch.unique_consecutive(buckets, return_counts=True)[1].tolist():
        stop = start + count
        per_chunk = max(
            1, CHUNK_CONTEXT_BYTES // (sorted_seq_lens[stop - 1] * context_bytes_per_token)
        )
        bounds += [(s, min(s + per_chunk, stop)) for s in range(start, stop, per_chunk)]
        start = stop
    return bounds


def pad_request_chunks(
    attn_metadata: CommonAttentionMetadata,
    block_size: int,
    *,
    short_query_len: int,
    context_bytes_per_token: int,
    data_device: torch.device | None = None,
) -> list[PaddedRequests]:
    """The requests with query rows, padded in chunks.

    Requests go in two groups — ``query_len <= short_query_len`` (decode rows), then the longer
    ones — each sorted by ``seq_len`` and cut into chunks whose gathered context
    (``num_chunk_reqs * max_seq_len * context_bytes_per_token``) fits ``CHUNK_CONTEXT_BYTES``
    (at least one request per chunk). Empty groups are left out; an empty (u)batch gives ``[]``.
    The index and mask tensors are moved to ``data_device`` (default: the metadata's device).
    """
    if data_device is None:
        data_device = attn_metadata.query_start_loc.device
    qsl = attn_metadata.query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = attn_metadata.seq_lens.long()
    is_short = query_lens <= short_query_len
    chunks = []
    for selected in (is_short & (query_lens > 0), ~is_short):
        req_ids = selected.nonzero().flatten()
        if not req_ids.numel():
            continue
        order = seq_lens[req_ids].argsort(stable=True)
        req_ids = req_ids[order]
        # host sync (free on CPU): the padded shapes must be Python ints
        group_seq_lens = seq_lens[req_ids].tolist()  # ascending
        group_query_lens = query_lens[req_ids].tolist()
        for start, stop in _chunk_bounds(group_seq_lens, context_bytes_per_token):
            chunks.append(
                _pad_chunk(
                    req_ids[start:stop],
                    qsl,
                    query_lens,
                    seq_lens,
                    attn_metadata,
                    block_size=block_size,
                    max_query_len=max(group_query_lens[start:stop]),
                    max_seq_len=group_seq_lens[stop - 1],
                    data_device=data_device,
                )
            )
    return chunks


def plan_key(
    block_size: int, short_query_len: int, context_bytes_per_token: int, data_device: torch.device
) -> tuple:
    """The ``attn_metadata.derived`` key of the padding plan ``request_chunks`` builds from these
    arguments; caches derived from that plan (masks, gather rows) extend it."""
    return ("pad_request_chunks", block_size, short_query_len, context_bytes_per_token, data_device)


def request_chunks(
    attn_metadata: CommonAttentionMetadata,
    block_size: int,
    *,
    short_query_len: int,
    context_bytes_per_token: int,
    data_device: torch.device,
) -> list[PaddedRequests]:
    """``pad_request_chunks``, built by the first layer of a (u)batch and reused by the others
    (cached in ``attn_metadata.derived`` under ``plan_key`` of the same arguments: every layer has
    the same requests and block table)."""
    return attn_metadata.derived(
        plan_key(block_size, short_query_len, context_bytes_per_token, data_device),
        lambda: pad_request_chunks(
            attn_metadata,
            block_size,
            short_query_len=short_query_len,
            context_bytes_per_token=context_bytes_per_token,
            data_device=data_device,
        ),
    )


def _gather_rows(x: Tensor, chunk: PaddedRequests) -> Tensor:
    """``x[chunk.gather_rows]``: ``[num_tokens, *E]`` -> ``[num_chunk_reqs, max_query_len, *E]``,
    by ``index_select`` (whole-row copies, faster than advanced indexing's generic kernel:
    docs/hardware.md, "Plain-torch attention")."""
    rows = x.index_select(0, chunk.gather_rows.flatten())
    return rows.view(*chunk.gather_rows.shape, *x.shape[1:])


def gather_context(cache: Tensor, chunk: PaddedRequests) -> Tensor:
    """Each request's first ``max_seq_len`` cache rows: cache ``[num_blocks, block_size, *E]`` ->
    ``[num_chunk_reqs, max_seq_len, *E]`` (rows past a request's ``seq_len`` are other data)."""
    gathered = cache.index_select(0, chunk.blocks.flatten())  # [R * blocks, block_size, *E]
    return gathered.view(chunk.num_reqs, -1, *cache.shape[2:])[:, : chunk.max_seq_len]


def _gqa_masks(chunks: list[PaddedRequests], group_size: int, dtype: torch.dtype) -> list[Tensor]:
    """Per chunk the additive mask ``[R, 1, group_size * Q, S]`` in ``dtype`` (0 = attend,
    -inf = masked): what SDPA makes of a bool mask (``convert_boolean_attn_mask``), built once
    per (u)batch instead of in every layer."""
    masks = []
    for chunk in chunks:  # chunks, not requests
        num_reqs, q_len, s_len = chunk.num_reqs, chunk.max_query_len, chunk.max_seq_len
        mask = chunk.attn_mask[:, None].expand(num_reqs, group_size, q_len, s_len)
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive.masked_fill_(~mask, float("-inf"))
        masks.append(additive.reshape(num_reqs, 1, group_size * q_len, s_len))
    return masks


def _kv_gather(
    kv_cache: Tensor,
    chunks: list[PaddedRequests],
    attn_metadata: CommonAttentionMetadata,
    plan: tuple,
) -> list[Callable[[], Tensor]]:
    """Per chunk a function returning its requests' K and V blocks ``[2 * R * num_blocks,
    block_size, *E]`` (K blocks first), gathered from ``kv_cache`` ``[2, num_cache_blocks,
    block_size, *E]``.

    A contiguous cache is gathered as rows of its ``[2 * num_cache_blocks, -1]`` view
    (``index_select`` on dim 0 copies whole rows with ``memcpy``; on dim 1 of the 5-d cache it
    takes a slower path) into one scratch buffer shared by the chunks and by every layer of the
    (u)batch (``attn_metadata.derived``; the layers run one after the other and each chunk's
    result is consumed before the next gather), so no chunk pays for freshly allocated pages.
    Other caches take ``index_select`` on dim 1. ``plan`` is the key of the padding plan
    ``chunks`` is (``plan_key``), so the row indices cached per plan never serve another plan's
    chunks.
    """
    if not kv_cache.is_contiguous():
        return [
            lambda chunk=chunk: kv_cache.index_select(1, chunk.blocks.flatten()) for chunk in chunks
        ]
    num_cache_blocks = kv_cache.shape[1]
    rows = attn_metadata.derived(
        ("kv_gather_rows", plan, num_cache_blocks, kv_cache.device),
        lambda: [
            torch.cat((c.blocks.flatten(), c.blocks.flatten() + num_cache_blocks)) for c in chunks
        ],
    )
    flat = kv_cache.view(2 * num_cache_blocks, -1)
    max_rows = max((r.numel() for r in rows), default=0)
    scratch = attn_metadata.derived(
        ("kv_gather_scratch", max_rows, flat.shape[1], kv_cache.dtype, kv_cache.device),
        lambda: flat.new_empty(max_rows, flat.shape[1]),
    )
    return [
        lambda r=r: torch.index_select(flat, 0, r, out=scratch[: r.numel()]).view(
            r.numel(), *kv_cache.shape[2:]
        )
        for r in rows
    ]


def _kernel_inputs(attn_metadata: CommonAttentionMetadata) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(block_table, seq_lens, query_start_loc, req_ids) for ``cpu_kernels().paged_attention``:
    the metadata as contiguous int32 and the int64 ids of the requests with query rows. Built once
    per (u)batch and shared by every layer."""

    def build() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qsl = attn_metadata.query_start_loc.contiguous()
        req_ids = ((qsl[1:] - qsl[:-1]) > 0).nonzero().flatten()
        return (
            attn_metadata.block_table.contiguous(),
            attn_metadata.seq_lens.contiguous(),
            qsl,
            req_ids,
        )

    return attn_metadata.derived("paged_attention_kernel_inputs", build)


def _paged_attention_kernel(query: Tensor, kv_cache: Tensor) -> Callable[..., None] | None:
    """Our compiled CPU kernel that attends over the paged cache in place (``moe.kernels``),
    where it applies: CPU tensors of one dtype (float32, float64, bfloat16), a contiguous cache,
    no tracer running and the kernels built for this CPU's vector ISA (AVX2 or AVX-512,
    the platform's ``cpu_capability().isa``; a CPU with neither builds nothing); else None."""
    if (
        query.device.type != "cpu"
        or query.dtype != kv_cache.dtype
        or query.dtype not in (torch.float32, torch.float64, torch.bfloat16)
        or not kv_cache.is_contiguous()
        or is_tracing()
    ):
        return None
    kernels = cpu_kernels(current_platform().cpu_capability().isa)
    if kernels is None:
        return None
    return kernels.paged_attention


def batched_paged_attention(
    query: Tensor, kv_cache: Tensor, attn_metadata: CommonAttentionMetadata, *, scale: float
) -> Tensor:
    """Attention of every query row over its request's cached context (K/V already written).

    On the CPU our compiled kernel computes every request reading K/V in place through the block
    table (``moe/kernels/csrc/paged_attention_cpu.cpp``; faster than the padded SDPA chunks on
    decode rows and prefills: docs/benchmarks.md, "Micro-benchmarks").
    Elsewhere, or where it does not apply (``_paged_attention_kernel``), requests are padded in
    chunks and attend through ``scaled_dot_product_attention``.

    Args:
        query: [num_tokens, num_heads, head_dim] (rotated).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; num_heads must be a
            multiple of num_kv_heads (query head h reads KV head
            ``h // (num_heads // num_kv_heads)``).
        attn_metadata: this (u)batch's metadata; its padding plan and masks are built by the
            first layer that attends and reused by the others (``attn_metadata.derived``).
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype; rows of no request are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    kernel = _paged_attention_kernel(query, kv_cache)
    if kernel is not None:
        out = query.new_zeros(num_tokens, num_heads, head_dim)
        block_table, seq_lens, query_start_loc, req_ids = _kernel_inputs(attn_metadata)
        if req_ids.numel():
            kernel(
                out,
                query.contiguous(),
                kv_cache[0],
                kv_cache[1],
                block_table,
                seq_lens,
                query_start_loc,
                req_ids,
                scale,
            )
        return out
    return _padded_sdpa_attention(query, kv_cache, attn_metadata, scale=scale)


def _padded_sdpa_attention(
    query: Tensor, kv_cache: Tensor, attn_metadata: CommonAttentionMetadata, *, scale: float
) -> Tensor:
    """``batched_paged_attention`` in plain torch: the requests padded in chunks (the padding plan,
    masks and gather rows built by the first layer and reused), one SDPA call per chunk."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    out = query.new_zeros(num_tokens + 1, num_heads, head_dim)  # last row: scratch for padding
    block_size = kv_cache.shape[2]
    context_bytes = 2 * num_kv_heads * head_dim * kv_cache.element_size()
    chunks = request_chunks(
        attn_metadata,
        block_size,
        short_query_len=1,
        context_bytes_per_token=context_bytes,
        data_device=query.device,
    )
    plan = plan_key(block_size, 1, context_bytes, query.device)
    masks = attn_metadata.derived(
        ("gqa_masks", plan, group_size, query.dtype),
        lambda: _gqa_masks(chunks, group_size, query.dtype),
    )
    gather = _kv_gather(kv_cache, chunks, attn_metadata, plan)
    for chunk, mask, kv in zip(chunks, masks, gather, strict=True):
        num_reqs, q_len, s_len = chunk.num_reqs, chunk.max_query_len, chunk.max_seq_len
        # GQA without copying K/V per query head: the group_size query heads sharing a KV head
        # become extra query rows of that KV head ([R, KVH, G * Q, D]).
        q = _gather_rows(query, chunk).view(num_reqs, q_len, num_kv_heads, group_size, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group_size * q_len, head_dim)
        # K and V of every chunk request in one gather: [2, R, S, KVH, D]
        kv = kv().view(2, num_reqs, -1, num_kv_heads, head_dim)[:, :, :s_len].to(query.dtype)
        o = F.scaled_dot_product_attention(
            q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=mask, scale=scale
        )
        o = o.view(num_reqs, num_kv_heads, group_size, q_len, head_dim).permute(0, 3, 1, 2, 4)
        # padding slots all go to the scratch row (index_copy_ with repeats there: any one wins)
        out.index_copy_(0, chunk.scatter_rows.flatten(), o.reshape(-1, num_heads, head_dim))
    return out[:num_tokens]


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
) -> Tensor:
    """MLA of every query row over its request's cached latents, absorbed for requests with at
    most ``absorb_max_query_len`` query rows and expanded for the others (as the per-request
    reference decides; see ``moe.layers.mla``). On the CPU the absorbed requests attend in our
    compiled kernel over the latents in place (``_mla_absorbed_kernel``), where it applies
    (``_paged_attention_kernel``); elsewhere, and for the expanded requests, padded chunks attend
    through ``scaled_dot_product_attention``.

    Args:
        q_nope: [num_tokens, num_heads, nope]; q_pe: [num_tokens, num_heads, rope] (rotated).
        kv_b_weight: [num_heads * (nope + v), kv_lora_rank] (``kv_b_proj.weight``).
        kv_cache: [num_blocks, block_size, kv_lora_rank + rope].
        expand: ``kv_b_proj`` as a function of latents [..., kv_lora_rank] (the layer's
            ``Linear``, which runs its packed weight on the CPU); default ``F.linear`` with
            ``kv_b_weight``.

    Returns:
        [num_tokens, num_heads, v] in q_nope's dtype; rows of no request are zero.
    """
    num_tokens, num_heads, nope = q_nope.shape
    w_kv = kv_b_weight.view(num_heads, -1, kv_lora_rank)  # [H, nope + v, r]
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    v_dim = w_uv.shape[1]
    if expand is None:
        expand = functools.partial(F.linear, weight=kv_b_weight)
    out = q_nope.new_zeros(num_tokens + 1, num_heads, v_dim)  # last row: scratch for padding
    chunks = request_chunks(
        attn_metadata,
        kv_cache.shape[1],
        short_query_len=absorb_max_query_len,
        context_bytes_per_token=kv_cache.shape[2] * kv_cache.element_size(),
        data_device=q_nope.device,
    )
    kernel = _paged_attention_kernel(q_nope, kv_cache)
    if kernel is not None:
        _mla_absorbed_kernel(
            kernel,
            out,
            (q_nope, q_pe),
            (w_uk, w_uv),
            kv_cache,
            attn_metadata,
            absorb_max_query_len=absorb_max_query_len,
            scale=scale,
        )
        expanded = [c for c in chunks if c.max_query_len > absorb_max_query_len]
        if expanded:
            query = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, nope + rope]
            for chunk in expanded:
                rows = gather_context(kv_cache, chunk).to(q_nope.dtype)
                kv = _mla_expand(rows, expand, num_heads, nope=nope, kv_lora_rank=kv_lora_rank)
                _expanded_kernel(kernel, out[:num_tokens], query, kv, chunk, attn_metadata, scale)
        return out[:num_tokens]
    for chunk in chunks:
        rows = gather_context(kv_cache, chunk).to(q_nope.dtype)  # [R, S, r + rope]
        qn = _gather_rows(q_nope, chunk).transpose(1, 2)  # [R, H, Q, nope]
        qp = _gather_rows(q_pe, chunk).transpose(1, 2)  # [R, H, Q, rope]
        mask = chunk.attn_mask[:, None]  # [R, 1, Q, S]
        if chunk.max_query_len <= absorb_max_query_len:
            o = _mla_absorbed(qn, qp, rows, mask, w_uk, w_uv, scale=scale)
        else:
            o = _mla_expanded(qn, qp, rows, mask, expand, kv_lora_rank=kv_lora_rank, scale=scale)
        out.index_copy_(0, chunk.scatter_rows.flatten(), o.transpose(1, 2).flatten(0, 1))
    return out[:num_tokens]


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
    weights: tuple[Tensor, Tensor],
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    absorb_max_query_len: int,
    scale: float,
) -> None:
    """``_mla_absorbed`` of every request with at most ``absorb_max_query_len`` query rows in one
    call of our compiled paged kernel, which reads the latents in place: one KV head whose keys
    are the cache rows ``[kv_c, k_pe]`` and whose values are their first ``kv_lora_rank``
    elements (the multi-query form). Writes those requests' rows of ``out`` [T + 1, H, v].

    Args: query (q_nope [T, H, nope], q_pe [T, H, rope]), weights (w_uk [H, nope, r], w_uv
    [H, v, r]), kv_cache [num_blocks, block_size, r + rope] (contiguous, q_nope's dtype).
    """
    (q_nope, q_pe), (w_uk, w_uv) = query, weights
    short = _short_requests(attn_metadata, absorb_max_query_len)
    if not short.rows.numel():
        return
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


def _expanded_kernel(
    kernel: Callable[..., None],
    out: Tensor,
    query: Tensor,
    kv: tuple[Tensor, Tensor],
    chunk: PaddedRequests,
    attn_metadata: CommonAttentionMetadata,
    scale: float,
) -> None:
    """Attention of the chunk's requests over their expanded keys and values in our compiled
    kernel (each request's context one block of ``max_seq_len`` slots: no padding is computed).

    Args: out [T, H, v] (the chunk's rows are written), query [T, H, nope + rope], kv (keys
    [R, S, H, nope + rope], values [R, S, H, v]) from ``_mla_expand``.
    """
    _, seq_lens, query_start_loc, _ = _kernel_inputs(attn_metadata)
    block_table = torch.zeros(len(seq_lens), 1, dtype=torch.int32, device=seq_lens.device)
    block_table[chunk.req_ids, 0] = torch.arange(
        chunk.num_reqs, dtype=torch.int32, device=seq_lens.device
    )
    k, v = kv
    kernel(out, query, k, v, block_table, seq_lens, query_start_loc, chunk.req_ids, scale)


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
