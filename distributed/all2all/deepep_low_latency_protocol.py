"""The packing of our DeepEP low-latency emulation (``TorchDistributedBuffer.low_latency_*``).

Legend: R ranks, E experts, L = E // R local experts, C = the call's capacity, H = hidden, T
tokens, K = num_topk, B = C * min(K, L): the most rows one rank sends another.

Dispatch: a token goes once to each of its top-k experts. Each rank sends every peer one block of
a size both know, ``[L int64 counts | B rows]``, its rows for that peer packed expert-major; the
receiver lays them out as DeepEP does (``recv_x [L, R * C, H]``, source ranks in order, and
``recv_count [L]``). Combine returns exactly the received rows; the source sums
``topk_weights[t, k] * row``. Buffers hold the blocks to send, then the own block, then the
received ones: the own rows never travel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from distributed.all2all.base import accumulation_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from ``low_latency_dispatch`` (DeepEP's handle)."""

    num_max_dispatch_tokens_per_rank: int  # the call's capacity C
    hidden: int
    num_experts: int
    # [T, K] int64 row of each (token, slot)'s output in the combine's receive view (own rows
    # first, then each other rank's); -1 = no expert
    pair_row: Tensor
    num_sent_rows: tuple[int, ...]  # per rank, the rows sent to it (= rows combine gets back)
    # [R, L] int64 rows received per source rank and local expert, and [1] bool: both written
    # by the dispatch's hook
    recv_layout: Tensor
    is_received: Tensor


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
    with the ``[L]`` int64 counts, B = ``num_rows`` token rows, then padding to 8-byte alignment.
    Rows of one width make a buffer one ``[rows, H]`` matrix: packing and unpacking are one row
    ``index_select`` / ``index_copy_`` each."""

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
        """``[num_blocks, L]`` int64 view of the counts in ``buf [num_blocks, rows_per_block,
        H]`` (contiguous; a block's stride is a multiple of 8 bytes)."""
        blocks = buf.reshape(buf.shape[0], -1).view(torch.uint8)
        return blocks[:, : 8 * self.num_local].view(torch.int64)

    def flat_row(self, block: Tensor, row: Tensor) -> Tensor:
        """Row of ``(block, token row)`` in ``buf.view(-1, H)``."""
        return block * self.rows_per_block + self.num_header_rows + row


def pack_dispatch(
    x: Tensor, topk_idx: Tensor, capacity: int, *, num_experts: int, rank: int, num_ranks: int
) -> tuple[Tensor, LowLatencyHandle, int]:
    """``(buf [2R - 1, rows_per_block, H] x's dtype, handle, billed bytes)``: ``buf[:R]`` one
    block per destination (``slot_order`` send side), ``buf[R:]`` for the peers' blocks. The bill
    is what DeepEP puts on the wire: the valid rows for other ranks and the counts.

    Raises:
        ValueError: more than B rows for one rank (only possible with repeated expert ids).
    """
    hidden, num_local, device = x.shape[1], num_experts // num_ranks, x.device
    block = BlockLayout.of(capacity, topk_idx.shape[1], num_local, hidden, x.element_size())
    per_expert, position = expert_positions(topk_idx, num_experts)
    sent = per_expert.view(num_ranks, num_local)
    num_sent_rows = sent.sum(1).tolist()  # host sync (small): the combine's split sizes
    if num_sent_rows and max(num_sent_rows) > block.num_rows:
        raise ValueError(
            f"low_latency_dispatch on rank {rank}: {max(num_sent_rows)} rows for one rank exceed "
            f"{block.num_rows} = capacity * min(num_topk, num_local_experts): a token names the "
            f"same expert twice"
        )
    buf = torch.empty(2 * num_ranks - 1, block.rows_per_block, hidden, dtype=x.dtype, device=device)
    send_slot = slot_order(rank, num_ranks, own_first=False, device=device)
    block.counts(buf)[:num_ranks].index_copy_(0, send_slot, sent)
    valid = position >= 0
    expert = topk_idx[valid]
    token = torch.arange(x.shape[0], device=device).unsqueeze(1).expand_as(valid)[valid]
    dest, block_row = expert // num_local, exclusive_cumsum(sent, 1).view(-1)[expert]
    block_row = block_row + position[valid]
    buf.view(-1, hidden).index_copy_(
        0, block.flat_row(send_slot[dest], block_row), x.index_select(0, token)
    )
    handle = LowLatencyHandle(
        num_max_dispatch_tokens_per_rank=capacity,
        hidden=hidden,
        num_experts=num_experts,
        pair_row=_pair_rows(topk_idx, valid, dest, block_row, sent.sum(1), rank),
        num_sent_rows=tuple(num_sent_rows),
        recv_layout=torch.zeros(num_ranks, num_local, dtype=torch.int64, device=device),
        is_received=torch.zeros(1, dtype=torch.bool),
    )
    num_remote = sum(num_sent_rows) - num_sent_rows[rank]
    num_bytes = num_remote * hidden * x.element_size() + (num_ranks - 1) * 8 * num_local
    return buf, handle, num_bytes


def _pair_rows(topk_idx, valid, dest, block_row, num_sent_rows: Tensor, rank: int) -> Tensor:
    """``[T, K]`` the row of each pair's output in the combine's receive view: own rows first,
    then every other rank's in rank order; -1 where no expert is selected."""
    num_ranks = num_sent_rows.shape[0]
    recv_order = [rank] + [p for p in range(num_ranks) if p != rank]
    chunk_start = torch.zeros(num_ranks, dtype=torch.int64, device=topk_idx.device)
    chunk_start[recv_order] = exclusive_cumsum(num_sent_rows[recv_order], 0)
    pair_row = torch.full_like(topk_idx, -1)
    pair_row[valid] = chunk_start[dest] + block_row
    return pair_row


def unpack_dispatch(
    blocks: Tensor, handle: LowLatencyHandle, recv_x: Tensor, recv_count: Tensor, *, rank: int
) -> None:
    """The hook's work: ``blocks [R, rows_per_block, H]`` (``slot_order`` receive side: own block
    first) into DeepEP's layout ``recv_x`` / ``recv_count``; marks ``handle`` received.

    Raises:
        RuntimeError: a received count outside [0, C] (the ranks disagree on C, H or dtype).
    """
    num_ranks, (num_local, num_slots, hidden) = blocks.shape[0], recv_x.shape
    capacity = handle.num_max_dispatch_tokens_per_rank
    block = BlockLayout.of(
        capacity, handle.pair_row.shape[1], num_local, hidden, recv_x.element_size()
    )
    recv_slot = slot_order(rank, num_ranks, own_first=True, device=recv_x.device)
    layout = block.counts(blocks)[recv_slot]  # source-rank order
    if bool(((layout < 0) | (layout > capacity)).any()):  # host sync (small)
        raise RuntimeError(
            f"low_latency_dispatch on rank {rank}: received row counts {layout.tolist()} "
            f"outside [0, {capacity}]: the ranks disagree on num_max_dispatch_tokens_per_rank, "
            f"hidden or dtype"
        )
    src, local_expert, _, block_row, packed_row = valid_rows(layout, capacity)
    rows = blocks.reshape(-1, hidden).index_select(0, block.flat_row(recv_slot[src], block_row))
    recv_x.view(-1, hidden).index_copy_(0, local_expert * num_slots + packed_row, rows)
    recv_count.copy_(layout.sum(0))
    handle.recv_layout.copy_(layout)
    handle.is_received.fill_(True)


def check_combine(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: LowLatencyHandle, num_ranks: int
) -> None:
    """ValueError unless ``x`` is ``[L, R * C, H]``, the top-k tensors the dispatched ``[T, K]``
    and the dispatch's hook has run."""
    capacity, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
    num_local = handle.num_experts // num_ranks
    if x.shape != (num_local, num_ranks * capacity, hidden):
        raise ValueError(
            f"low_latency_combine x must be [{num_local}, {num_ranks * capacity}, {hidden}], "
            f"got {list(x.shape)}"
        )
    if topk_idx.shape != handle.pair_row.shape or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_idx {list(topk_idx.shape)} / topk_weights {list(topk_weights.shape)} must "
            f"be the dispatched {list(handle.pair_row.shape)}"
        )
    if not bool(handle.is_received):
        raise ValueError("low_latency_combine before the dispatch's receive hook ran")


def pack_combine(
    x: Tensor, handle: LowLatencyHandle, *, rank: int, num_ranks: int
) -> tuple[Tensor, int, int, tuple[list[int], list[int]]]:
    """``(buf [rows, H] x's dtype, num_send, billed bytes, (input splits, output splits))``:
    ``buf[:num_send]`` the rows for the peers (rank order), then this rank's own rows, then the
    peers' rows coming back; ``buf[num_send:]`` is ``handle.pair_row``'s view."""
    layout = handle.recv_layout
    num_back = layout.sum(1).tolist()  # host sync (small): rows to return to each rank
    num_send = sum(num_back) - num_back[rank]
    num_recv = sum(handle.num_sent_rows) - handle.num_sent_rows[rank]
    buf = torch.empty(sum(num_back) + num_recv, handle.hidden, dtype=x.dtype, device=x.device)
    send_slot = slot_order(rank, num_ranks, own_first=False, device=x.device)
    back = torch.tensor(num_back, dtype=torch.int64, device=x.device)
    chunk_start = exclusive_cumsum(back[send_slot.argsort()], 0)[send_slot]
    src, local_expert, _, block_row, packed_row = valid_rows(
        layout, handle.num_max_dispatch_tokens_per_rank
    )
    rows = x.reshape(-1, handle.hidden).index_select(0, local_expert * x.shape[1] + packed_row)
    buf.index_copy_(0, chunk_start[src] + block_row, rows)
    splits = (peer_splits(num_back, rank), peer_splits(list(handle.num_sent_rows), rank))
    return buf, num_send, num_send * handle.hidden * x.element_size(), splits


def weighted_sum(
    rows: Tensor, handle: LowLatencyHandle, topk_weights: Tensor, combined_x: Tensor
) -> None:
    """The combine's hook work: ``combined_x [T, H] = sum_k topk_weights[t, k] * row(t, k)``
    over the received ``rows`` (``handle.pair_row``), in float32 (float64 for float64)."""
    if rows.shape[0] == 0:  # no (token, expert) pair anywhere: nothing came back
        combined_x.zero_()
        return
    acc_dtype = accumulation_dtype(rows.dtype)
    num_tokens, hidden = combined_x.shape
    # each token's K rows (a pair with no expert reads row 0 with weight 0)
    picked = rows.index_select(0, handle.pair_row.clamp(min=0).view(-1))
    picked = picked.view(num_tokens, -1, hidden).to(acc_dtype)
    weights = torch.where(handle.pair_row >= 0, topk_weights.to(acc_dtype), 0.0)
    combined_x.copy_((picked * weights.unsqueeze(-1)).sum(1))
