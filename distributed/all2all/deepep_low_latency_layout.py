"""Index math and block layout of the emulated DeepEP low-latency protocol
(``deepep_low_latency_protocol``), kept apart so that each piece can be read and tested alone.

Legend: R = num_ranks, E = num_experts, L = E // R local experts, C = capacity
(``num_max_dispatch_tokens_per_rank``), H = hidden, T = num_tokens, K = num_topk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def expert_positions(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``(num_tokens_per_expert [E] int64, position [T, K] int64)``: a pair's position counts
    the earlier (token, slot) pairs sent to the same expert; -1 where no expert is selected."""
    flat = topk_idx.reshape(-1)
    expert = torch.where(flat >= 0, flat, num_experts)  # -1 -> an extra bucket, dropped below
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts + 1)
    starts = counts.cumsum(0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[expert[order]]
    position = torch.where(flat >= 0, position, -1)
    return counts[:num_experts], position.view(topk_idx.shape)


def exclusive_cumsum(counts: Tensor, dim: int) -> Tensor:
    return counts.cumsum(dim) - counts


def valid_rows(layout: Tensor, capacity: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """For ``layout [R, L]`` row counts: ``(rank, local_expert, row_in_expert, block_row,
    packed_row)`` of every valid row: ``block_row`` its row in the source rank's block
    (expert-major), ``packed_row`` its row in ``recv_x[local_expert]`` (source-rank order)."""
    row = torch.arange(capacity, device=layout.device)
    rank, local_expert, row_in_expert = (row < layout.unsqueeze(-1)).nonzero(as_tuple=True)
    block_row = exclusive_cumsum(layout, 1)[rank, local_expert] + row_in_expert
    packed_row = exclusive_cumsum(layout, 0)[rank, local_expert] + row_in_expert
    return rank, local_expert, row_in_expert, block_row, packed_row


def slot_order(rank: int, num_ranks: int, *, own_first: bool, device) -> Tensor:
    """``[R]`` int64: each rank's slot among the blocks of a buffer, the other ranks in rank order
    and this rank's own block last (send side) or first (receive side)."""
    others = [p for p in range(num_ranks) if p != rank]
    order = [rank, *others] if own_first else [*others, rank]
    slots = torch.empty(num_ranks, dtype=torch.int64, device=device)
    slots[torch.tensor(order, device=device)] = torch.arange(num_ranks, device=device)
    return slots


def peer_splits(sizes: list[int], rank: int) -> list[int]:
    """Split sizes for ``all_to_all_single`` that leave this rank's own part out (0)."""
    return [0 if p == rank else n for p, n in enumerate(sizes)]


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockLayout:
    """One dispatch block as rows of the payload dtype: ``num_header_rows`` rows whose bytes start
    with the ``[L]`` int64 counts, then B = ``num_rows`` token rows, then padding so that every
    block starts 8-byte aligned (the counts are read through an int64 view). Rows of one width
    make the whole buffer one ``[rows, H]`` matrix: packing and unpacking are a row
    ``index_select`` / ``index_copy_`` each (advanced indexing is several times slower)."""

    num_local: int
    num_header_rows: int
    num_rows: int
    rows_per_block: int

    @classmethod
    def of(cls, capacity: int, num_topk: int, num_local: int, hidden: int, itemsize: int):
        row_bytes = hidden * itemsize
        num_header_rows = -(-8 * num_local // row_bytes)
        num_rows = capacity * min(num_topk, num_local)
        align = 8 // math.gcd(row_bytes, 8)  # rows per 8-byte-aligned unit
        rows_per_block = -(-(num_header_rows + num_rows) // align) * align
        return cls(
            num_local=num_local,
            num_header_rows=num_header_rows,
            num_rows=num_rows,
            rows_per_block=rows_per_block,
        )

    def counts(self, buf: Tensor) -> Tensor:
        """``[num_blocks, L]`` int64 view of the counts in ``buf [num_blocks, rows_per_block, H]``
        (contiguous)."""
        # whole blocks as bytes: the row stride (rows_per_block rows) is a multiple of 8 bytes
        blocks = buf.reshape(buf.shape[0], -1).view(torch.uint8)
        return blocks[:, : 8 * self.num_local].view(torch.int64)

    def flat_row(self, block: Tensor, row: Tensor) -> Tensor:
        """Row of ``(block, token row)`` in ``buf.view(-1, H)``."""
        return block * self.rows_per_block + self.num_header_rows + row
