"""Paged attention through torch's ``flex_attention``, reading the KV cache in place
(``flex_paged_attention``, its block mask ``flex_block_mask``), after vLLM's FlexAttention
backend. ValueError where a cache block is shared by two requests. Design: docs/hardware.md,
"FLEX_ATTENTION"."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata

# Query rows per block-mask tile (vLLM's FlexAttention backend takes 16 too): a tile holding rows of
# several requests visits the blocks of each, so smaller tiles visit fewer blocks in decode.
Q_BLOCK_SIZE = 16

FlexAttention = Callable[..., Tensor]  # flex_attention's signature
# a block mask for the forward only (no transposed copy for a backward), where torch offers it
_FORWARD_ONLY = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


@functools.cache
def compiled_flex_attention() -> FlexAttention:
    """``flex_attention`` compiled whole (one fused kernel per shape class; eagerly it builds the
    full score matrix). Compiled at the first call, shapes made dynamic at the first change."""
    return torch.compile(flex_attention, fullgraph=True)


def _tile_kv_blocks(
    doc: Tensor, position: Tensor, block_table: Tensor, block_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The block lists of ``BlockMask.from_kv_blocks``, per tile of ``Q_BLOCK_SIZE`` rows
    (``doc`` / ``position`` [rows]: each row's request and position in it): (kv_num_blocks
    [tiles], kv_indices [tiles, most], full_kv_num_blocks [tiles], full_kv_indices [tiles,
    most_full]), int32. A tile visits the cache blocks of each of its requests up to that
    request's last row in the tile. A block is *full* (flex skips the mask function there) when
    all 16 rows of the tile belong to its request and its last slot precedes the tile's first
    row: every row keeps every slot of it. The requests' blocks are disjoint, so the lists need
    no deduplication."""
    num_rows = doc.numel()
    rows = torch.arange(num_rows, device=doc.device)
    # the last row of each (tile, request) pair: its request changes next, or its tile ends
    is_end = torch.ones(num_rows, dtype=torch.bool, device=doc.device)
    is_end[:-1] = (doc[1:] != doc[:-1]) | ((rows[1:] % Q_BLOCK_SIZE) == 0)
    ends = rows[is_end]
    is_start = torch.ones_like(is_end)
    is_start[1:] = is_end[:-1]
    starts = rows[is_start]  # the first row of each pair
    tiles = ends // Q_BLOCK_SIZE
    visited = position[ends] // block_size + 1  # blocks each pair visits: logical 0 .. n-1
    whole_tile = (ends - starts + 1) == Q_BLOCK_SIZE  # the tile's 16 rows, one request
    full = torch.where(whole_tile, (position[starts] + 1) // block_size, 0)
    num_tiles = -(-num_rows // Q_BLOCK_SIZE)
    owners = doc[ends]
    partial_lists = _tile_lists(tiles, owners, full, visited - full, num_tiles, block_table)
    full_lists = _tile_lists(tiles, owners, torch.zeros_like(full), full, num_tiles, block_table)
    return (*partial_lists, *full_lists)


def _tile_lists(
    tiles: Tensor,
    owners: Tensor,
    first: Tensor,
    count: Tensor,
    num_tiles: int,
    block_table: Tensor,
) -> tuple[Tensor, Tensor]:
    """(num [num_tiles] int32, indices [num_tiles, most] int32): per tile, the cache blocks of
    logical indices ``first .. first + count - 1`` of each of its (tile, request) pairs
    (``tiles``, ``owners``, ``first``, ``count``: [pairs]), in pair order."""
    device = tiles.device
    num = torch.zeros(num_tiles, dtype=torch.long, device=device)
    num.index_add_(0, tiles, count)
    total = int(count.sum())  # host read: metadata on the host in the engine
    pair = torch.repeat_interleave(
        torch.arange(count.numel(), device=device), count, output_size=total
    )
    flat = torch.arange(total, device=device)
    logical = first[pair] + flat - (torch.cumsum(count, 0) - count)[pair]
    tile_start = torch.cumsum(num, 0) - num
    column = flat - tile_start[tiles[pair]]
    indices = torch.zeros(num_tiles, max(int(num.max()), 1), dtype=torch.long, device=device)
    indices[tiles[pair], column] = block_table[owners[pair], logical].long()
    return num.to(torch.int32), indices.to(torch.int32)


def _block_owners(
    block_table: Tensor, seq_lens: Tensor, block_size: int, num_cache_blocks: int
) -> tuple[Tensor, Tensor]:
    """(owner, logical), each [num_cache_blocks] int64: the request holding each cache block and
    the block's index in that request's context, -1 for blocks of no request.

    Raises:
        ValueError: a cache block held by two requests (or twice by one).
    """
    device = block_table.device
    num_blocks = -(-seq_lens.long() // block_size)  # [R]
    columns = torch.arange(block_table.shape[1], device=device)
    held = columns[None, :] < num_blocks[:, None]  # [R, M]
    blocks = block_table.long()[held]
    if torch.unique(blocks).numel() != blocks.numel():
        raise ValueError("FLEX_ATTENTION needs each KV cache block in one request's block table")
    owner = torch.full((num_cache_blocks,), -1, dtype=torch.long, device=device)
    logical = torch.full_like(owner, -1)
    owner[blocks] = torch.arange(block_table.shape[0], device=device)[:, None].expand_as(held)[held]
    logical[blocks] = columns[None, :].expand_as(held)[held]
    return owner, logical


def flex_block_mask(
    attn_metadata: CommonAttentionMetadata, block_size: int, num_cache_blocks: int, device
) -> BlockMask:
    """The block mask of ``attn_metadata``'s real query rows over a cache of
    ``num_cache_blocks`` blocks of ``block_size`` tokens, on ``device``; built once per (u)batch
    and shared by every layer (``attn_metadata.derived``)."""

    def build() -> BlockMask:
        num_rows = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc.long()
        seq_lens = attn_metadata.seq_lens.long()
        query_lens = attn_metadata.query_lens.long()
        doc = torch.repeat_interleave(
            torch.arange(attn_metadata.num_reqs, device=qsl.device),
            query_lens,
            output_size=num_rows,
        )  # [rows] the request of each row
        position = (
            torch.arange(num_rows, device=qsl.device) - qsl[doc] + (seq_lens - query_lens)[doc]
        )
        owner, logical = _block_owners(
            attn_metadata.block_table, seq_lens, block_size, num_cache_blocks
        )
        lists = _tile_kv_blocks(doc, position, attn_metadata.block_table, block_size)
        kv_num_blocks, kv_indices, full_num_blocks, full_indices = (
            t[None, None].to(device) for t in lists
        )
        doc, position, owner, logical = (t.to(device) for t in (doc, position, owner, logical))

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            block = kv_idx // block_size
            in_request = owner[block] == doc[q_idx]
            return in_request & (
                logical[block] * block_size + kv_idx % block_size <= position[q_idx]
            )

        return BlockMask.from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks=full_num_blocks,
            full_kv_indices=full_indices,
            BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
            mask_mod=mask_mod,
            seq_lengths=(num_rows, num_cache_blocks * block_size),
            **_FORWARD_ONLY,
        )

    return attn_metadata.derived(("flex_block_mask", block_size, num_cache_blocks, device), build)


def flex_paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    scale: float,
    flex: FlexAttention | None = None,
) -> Tensor:
    """Attention of every real query row over its request's cached context (K/V already
    written), in one ``flex_attention`` call reading the cache in place.

    Args:
        query: [num_tokens, num_heads, head_dim] (rotated), the cache's dtype.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], block_size a multiple of
            16 on a GPU; num_heads a multiple of num_kv_heads (GQA).
        attn_metadata: this (u)batch's metadata (its block mask is built by the first layer).
        scale: softmax scale.
        flex: the ``flex_attention`` to call (default: ``compiled_flex_attention()``).

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype; rows past ``num_actual_tokens`` zero.

    Raises:
        ValueError: query and cache dtypes differ, or a cache block is in two requests.
    """
    if query.dtype != kv_cache.dtype:
        raise ValueError(
            f"FLEX_ATTENTION reads the cache in place: query dtype {query.dtype} must equal the "
            f"cache's {kv_cache.dtype}"
        )
    num_tokens, num_heads, head_dim = query.shape
    _, num_cache_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    out = query.new_zeros(num_tokens, num_heads, head_dim)
    num_rows = attn_metadata.num_actual_tokens
    if num_rows == 0:
        return out
    block_mask = flex_block_mask(attn_metadata, block_size, num_cache_blocks, query.device)
    # [1, heads, slots, head_dim] views of the cache and the queries: no copies
    key, value = (
        kv_cache[i].view(-1, num_kv_heads, head_dim).transpose(0, 1)[None] for i in (0, 1)
    )
    attend = compiled_flex_attention() if flex is None else flex
    o = attend(
        query[:num_rows].transpose(0, 1)[None],
        key,
        value,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out[:num_rows] = o[0].transpose(0, 1)
    return out
