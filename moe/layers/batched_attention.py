"""Paged attention for all requests of a (u)batch at once, no Python loop over requests: padded
chunks through SDPA (``batched_paged_attention``), our CPU kernel where it applies
(``paged_attention_kernel``, ``KernelCut``). The padding plan, masks and host reads:
docs/hardware.md, "Batched paged attention (TORCH_SDPA)"."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.kernels.host import host_kernels
from moe.platforms.device_probes import is_host

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


@dataclass(frozen=True, slots=True)
class KernelCut:
    """Up to how many query rows a request attends in our compiled kernel rather than the padded
    SDPA chunks (``batched_paged_attention``): ``over_context`` for a query that follows a cached
    context at least as long as itself (a chunked prefill's later chunk), ``fresh`` otherwise
    (a prompt's first chunk). Measured once per machine (``moe.layers.attention_tuning``);
    ``inf`` means no cut."""

    fresh: float = math.inf
    over_context: float = math.inf

    def to_sdpa(self, query_lens: Tensor, seq_lens: Tensor) -> Tensor:
        """bool ``[num_reqs]``: the requests past the cut (``query_lens``, ``seq_lens``: int
        ``[num_reqs]``, as in the metadata)."""
        over_context = seq_lens - query_lens >= query_lens
        return torch.where(over_context, query_lens > self.over_context, query_lens > self.fresh)


KERNEL_EVERYWHERE = KernelCut()
SDPA_EVERYWHERE = KernelCut(fresh=0.0, over_context=0.0)


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
    past: KernelCut | None = None,
) -> list[PaddedRequests]:
    """The requests with query rows (only those ``past.to_sdpa`` selects, if given), padded in
    chunks.

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
    chosen = True if past is None else past.to_sdpa(query_lens, seq_lens)
    chunks = []
    for selected in (is_short & (query_lens > 0), ~is_short):
        req_ids = (selected & chosen).nonzero().flatten()
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
    block_size: int,
    short_query_len: int,
    context_bytes_per_token: int,
    data_device: torch.device,
    past: KernelCut | None = None,
) -> tuple:
    """The ``attn_metadata.derived`` key of the padding plan ``request_chunks`` builds from these
    arguments; caches derived from that plan (masks, gather rows) extend it."""
    return (
        "pad_request_chunks",
        block_size,
        short_query_len,
        context_bytes_per_token,
        data_device,
        past,
    )


def request_chunks(
    attn_metadata: CommonAttentionMetadata,
    block_size: int,
    *,
    short_query_len: int,
    context_bytes_per_token: int,
    data_device: torch.device,
    past: KernelCut | None = None,
) -> list[PaddedRequests]:
    """``pad_request_chunks``, built by the first layer of a (u)batch and reused by the others
    (cached in ``attn_metadata.derived`` under ``plan_key`` of the same arguments: every layer has
    the same requests and block table)."""
    return attn_metadata.derived(
        plan_key(block_size, short_query_len, context_bytes_per_token, data_device, past),
        lambda: pad_request_chunks(
            attn_metadata,
            block_size,
            short_query_len=short_query_len,
            context_bytes_per_token=context_bytes_per_token,
            data_device=data_device,
            past=past,
        ),
    )


def gather_rows(x: Tensor, chunk: PaddedRequests) -> Tensor:
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


def kernel_inputs(attn_metadata: CommonAttentionMetadata) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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


def attention_kernels(dtype: torch.dtype, kv_cache: Tensor) -> ModuleType | None:
    """Our compiled CPU kernels (``moe.kernels``) where they attend queries of ``dtype`` over
    ``kv_cache`` in place: a CPU cache of that dtype (float32, float64, bfloat16), contiguous, no
    tracer running and the kernels built for this CPU's vector ISA (AVX2 or AVX-512, the
    platform's ``cpu_capability().isa``; a CPU with neither builds nothing); else None."""
    if (
        dtype != kv_cache.dtype
        or dtype not in (torch.float32, torch.float64, torch.bfloat16)
        or not kv_cache.is_contiguous()
    ):
        return None
    return host_kernels(kv_cache)


def paged_attention_kernel(query: Tensor, kv_cache: Tensor) -> Callable[..., None] | None:
    """The kernel that attends ``query`` over ``kv_cache`` in place (``attention_kernels``' module
    ``paged_attention``, for a CPU query), else None."""
    kernels = attention_kernels(query.dtype, kv_cache) if is_host(query.device) else None
    return None if kernels is None else kernels.paged_attention


def batched_paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    scale: float,
    cut: KernelCut = KERNEL_EVERYWHERE,
) -> Tensor:
    """Attention of every query row over its request's cached context (K/V already written).

    On the CPU our compiled kernel computes the requests up to ``cut`` (the layer's measured
    ``KernelCut``) reading K/V in place through the block table
    (``moe/kernels/csrc/paged_attention_cpu.cpp``); the requests past it, and all requests where
    the kernel does not apply (``paged_attention_kernel``), are padded in chunks and attend
    through ``scaled_dot_product_attention``.

    Args:
        query: [num_tokens, num_heads, head_dim] (rotated).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; num_heads must be a
            multiple of num_kv_heads (query head h reads KV head
            ``h // (num_heads // num_kv_heads)``).
        attn_metadata: this (u)batch's metadata; its padding plan and masks are built by the
            first layer that attends and reused by the others (``attn_metadata.derived``).
        scale: softmax scale.
        cut: where the kernel hands requests to SDPA (default: nowhere).

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype; rows of no request are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    kernel = paged_attention_kernel(query, kv_cache)
    if kernel is None:
        return _padded_sdpa_attention(query, kv_cache, attn_metadata, scale=scale)
    block_table, seq_lens, query_start_loc, req_ids = kernel_inputs(attn_metadata)
    out = None
    if cut != KERNEL_EVERYWHERE:
        to_sdpa = attn_metadata.derived(
            ("to_sdpa", cut),
            lambda: cut.to_sdpa(attn_metadata.query_lens.long(), attn_metadata.seq_lens.long()),
        )
        if bool(to_sdpa.any()):  # host read: CPU metadata
            out = _padded_sdpa_attention(query, kv_cache, attn_metadata, scale=scale, past=cut)
            req_ids = req_ids[~to_sdpa[req_ids]]
    if out is None:
        out = query.new_zeros(num_tokens, num_heads, head_dim)
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


def _padded_sdpa_attention(
    query: Tensor,
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    scale: float,
    past: KernelCut | None = None,
) -> Tensor:
    """``batched_paged_attention`` in plain torch for every request, or for those past ``past``
    (the other rows stay zero): the requests padded in chunks (the padding plan, masks and gather
    rows built by the first layer and reused), one SDPA call per chunk."""
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
        past=past,
    )
    plan = plan_key(block_size, 1, context_bytes, query.device, past)
    masks = attn_metadata.derived(
        ("gqa_masks", plan, group_size, query.dtype),
        lambda: _gqa_masks(chunks, group_size, query.dtype),
    )
    gather = _kv_gather(kv_cache, chunks, attn_metadata, plan)
    for chunk, mask, kv in zip(chunks, masks, gather, strict=True):
        num_reqs, q_len, s_len = chunk.num_reqs, chunk.max_query_len, chunk.max_seq_len
        # GQA without copying K/V per query head: the group_size query heads sharing a KV head
        # become extra query rows of that KV head ([R, KVH, G * Q, D]).
        q = gather_rows(query, chunk).view(num_reqs, q_len, num_kv_heads, group_size, head_dim)
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
