"""The packing of our DeepEP low-latency emulation (``TorchDistributedBuffer.low_latency_*``): fixed
blocks both ways, rows placed and picked by indices computed on the device, nothing read to the
host. Blocks and buffers: docs/backends.md#low-latency-emulation-blocks-and-buffers.

Legend: R ranks, E experts, L = E // R local experts, C = the call's capacity (T <= C tokens per
rank), H = hidden, K = num_topk, B = C * min(K, L): the most rows one rank sends another."""

from __future__ import annotations

import math
import threading
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
    topk_shape: tuple[int, int]  # the dispatched [T, K]
    # written by the dispatch's hook, on x's device: [R, L] int64 rows received per source rank
    # and local expert; per received block row [R * B] int64, the row of recv_x (flattened) it
    # went to and the row of the combine's buffer (flattened) its output goes back in (the
    # scratch row for an empty block row)
    recv_layout: Tensor
    combine_src_row: Tensor
    combine_dst_row: Tensor
    is_received: threading.Event  # set by the dispatch's hook


def expert_positions(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``(num_tokens_per_expert [E] int64, position [T, K] int64)``: a pair's position counts
    the earlier (token, slot) pairs sent to the same expert; -1 where no expert is selected."""
    flat = topk_idx.reshape(-1)
    expert = torch.where(flat >= 0, flat, num_experts)  # -1 -> an extra bucket, dropped below
    order = torch.argsort(expert, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))  # bincount without a host read
    starts = counts.cumsum(0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[expert[order]]
    position = torch.where(flat >= 0, position, -1)
    return counts[:num_experts], position.view(topk_idx.shape)


def exclusive_cumsum(counts: Tensor, dim: int) -> Tensor:
    return counts.cumsum(dim) - counts


def received_rows(layout: Tensor, capacity: int, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where each token row of the received blocks goes, for ``layout [R, L]`` int64 >= 0 (each
    source's counts, its rows packed expert-major): ``(local_expert, packed_row, is_valid)``, each
    ``[R, num_rows]``: ``packed_row`` the row in ``recv_x[local_expert]`` (C slots per source, in
    source-rank order); ``is_valid`` False past a source's rows or its C-th row for one expert."""
    block_row = torch.arange(num_rows, device=layout.device).expand(layout.shape[0], -1)
    ends = layout.cumsum(1)
    local_expert = torch.searchsorted(ends, block_row.contiguous(), right=True)
    is_valid = local_expert < layout.shape[1]
    local_expert = local_expert.clamp(max=layout.shape[1] - 1)
    row_in_expert = block_row - (ends - layout).gather(1, local_expert)
    is_valid &= row_in_expert < capacity
    expert_start = exclusive_cumsum(layout.clamp(max=capacity), 0).gather(1, local_expert)
    return local_expert, expert_start + row_in_expert, is_valid


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


def block_buffer(num_blocks: int, rows_per_block: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """``(blocks [num_blocks, rows_per_block, H], rows [num_blocks * rows_per_block + 1, H])``,
    uninitialised, ``like``'s dtype and device: two views of one buffer, the last row of
    ``rows`` the scratch row (``scratch_row(rows)``)."""
    rows = like.new_empty(num_blocks * rows_per_block + 1, like.shape[-1])
    return rows[:-1].view(num_blocks, rows_per_block, -1), rows


def scratch_row(rows: Tensor) -> int:
    """The row of ``block_buffer``'s ``rows`` that takes the writes of empty slots."""
    return rows.shape[0] - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockLayout:
    """One dispatch block as rows of the payload dtype: ``num_header_rows`` rows whose bytes start
    with the ``[L]`` int64 counts and the ``[B]`` int64 source token ids, B = ``num_rows`` token
    rows, then padding to 8-byte alignment. Rows of one width make a buffer one ``[rows, H]``
    matrix: packing and unpacking are one row ``index_select`` / ``index_copy_`` each."""

    num_local: int
    num_header_rows: int
    num_rows: int
    rows_per_block: int

    @classmethod
    def of(cls, capacity: int, num_topk: int, num_local: int, hidden: int, itemsize: int):
        row_bytes = hidden * itemsize
        num_rows = capacity * min(num_topk, num_local)
        num_header_rows = -(-8 * (num_local + num_rows) // row_bytes)
        align = 8 // math.gcd(row_bytes, 8)  # rows per 8-byte-aligned unit
        rows_per_block = -(-(num_header_rows + num_rows) // align) * align
        return cls(
            num_local=num_local,
            num_header_rows=num_header_rows,
            num_rows=num_rows,
            rows_per_block=rows_per_block,
        )

    def _header(self, buf: Tensor, start: int, count: int) -> Tensor:
        blocks = buf.flatten(1).view(torch.uint8)
        return blocks[:, 8 * start : 8 * (start + count)].view(torch.int64)

    def counts(self, buf: Tensor) -> Tensor:
        """``[num_blocks, L]`` int64 view of the counts in ``buf [num_blocks, rows_per_block,
        H]`` (contiguous; a block's stride is a multiple of 8 bytes)."""
        return self._header(buf, 0, self.num_local)

    def src_token_idx(self, buf: Tensor) -> Tensor:
        """``[num_blocks, B]`` int64 view of each token row's token on its source rank (DeepEP's
        ``src_info``)."""
        return self._header(buf, self.num_local, self.num_rows)

    def flat_row(self, block: Tensor, row: Tensor) -> Tensor:
        """Row of ``(block, token row)`` in ``buf.view(-1, H)``."""
        return block * self.rows_per_block + self.num_header_rows + row


def pack_dispatch(
    x: Tensor,
    topk_idx: Tensor,
    capacity: int,
    *,
    num_experts: int,
    rank: int,
    num_ranks: int,
    debug_checks: bool,
) -> tuple[Tensor, LowLatencyHandle]:
    """``(buf [2R - 1, rows_per_block, H] x's dtype, handle)``: ``buf[:R]`` one block per
    destination (``slot_order`` send side), ``buf[R:]`` for the peers' blocks.

    Raises:
        ValueError: with ``debug_checks`` (``MOE_DBO_DEBUG_CHECKS=1``), more than B rows for one
            rank (only possible with repeated expert ids; without the check the excess rows are
            dropped).
    """
    hidden, num_local, device = x.shape[1], num_experts // num_ranks, x.device
    block = BlockLayout.of(capacity, topk_idx.shape[1], num_local, hidden, x.element_size())
    per_expert, position = expert_positions(topk_idx, num_experts)
    sent = per_expert.view(num_ranks, num_local)
    if debug_checks:
        _check_sent_rows(sent, block.num_rows, rank)
    buf, rows = block_buffer(2 * num_ranks - 1, block.rows_per_block, x)
    send_slot = slot_order(rank, num_ranks, own_first=False, device=device)
    block.counts(buf)[:num_ranks].index_copy_(0, send_slot, sent)
    # every (token, slot) pair: its block and row there, or nowhere (no expert, or past B)
    expert = topk_idx.reshape(-1).clamp(min=0)
    block_row = exclusive_cumsum(sent, 1).view(-1)[expert] + position.view(-1)
    is_placed = (position.view(-1) >= 0) & (block_row < block.num_rows)
    slot = send_slot[expert // num_local]
    token = torch.arange(x.shape[0], device=device).unsqueeze(1).expand_as(topk_idx).reshape(-1)
    token_grid = torch.zeros(num_ranks * block.num_rows + 1, dtype=torch.int64, device=device)
    grid_row = torch.where(is_placed, slot * block.num_rows + block_row, token_grid.shape[0] - 1)
    token_grid.index_copy_(0, grid_row, token)
    block.src_token_idx(buf)[:num_ranks].copy_(token_grid[:-1].view(num_ranks, -1))
    flat_row = torch.where(is_placed, block.flat_row(slot, block_row), scratch_row(rows))
    rows.index_copy_(0, flat_row, x.index_select(0, token))
    handle = LowLatencyHandle(
        num_max_dispatch_tokens_per_rank=capacity,
        hidden=hidden,
        num_experts=num_experts,
        topk_shape=tuple(topk_idx.shape),
        recv_layout=torch.zeros(num_ranks, num_local, dtype=torch.int64, device=device),
        combine_src_row=torch.empty(num_ranks * block.num_rows, dtype=torch.int64, device=device),
        combine_dst_row=torch.empty(num_ranks * block.num_rows, dtype=torch.int64, device=device),
        is_received=threading.Event(),
    )
    return buf, handle


def _check_sent_rows(sent: Tensor, num_rows: int, rank: int) -> None:
    """ValueError if ``sent [R, L]`` puts more than ``num_rows`` rows in one rank's block."""
    most = int(sent.sum(1).max()) if sent.numel() else 0  # host sync (small): debug only
    if most > num_rows:
        raise ValueError(
            f"low_latency_dispatch on rank {rank}: {most} rows for one rank exceed "
            f"{num_rows} = capacity * min(num_topk, num_local_experts): a token names the "
            f"same expert twice"
        )


def dispatch_link_bytes(buf: Tensor, handle: LowLatencyHandle, num_ranks: int) -> int:
    """Bytes DeepEP's dispatch puts on the wire for ``pack_dispatch``'s ``buf``: the valid rows
    for other ranks and their counts. Host sync (small): only an emulated link needs it."""
    num_local = handle.num_experts // num_ranks
    capacity, (_, num_topk) = handle.num_max_dispatch_tokens_per_rank, handle.topk_shape
    block = BlockLayout.of(capacity, num_topk, num_local, handle.hidden, buf.element_size())
    num_remote = int(block.counts(buf[: num_ranks - 1]).sum())
    return num_remote * handle.hidden * buf.element_size() + (num_ranks - 1) * 8 * num_local


def unpack_dispatch(
    blocks: Tensor,
    handle: LowLatencyHandle,
    recv_rows: Tensor,
    recv_count: Tensor,
    *,
    rank: int,
    debug_checks: bool,
) -> None:
    """The hook's work: ``blocks [R, rows_per_block, H]`` (``slot_order`` receive side: own block
    first) into DeepEP's layout, ``recv_rows`` (``block_buffer``'s rows of ``recv_x [L, R * C,
    H]``) and ``recv_count [L]``; fills ``handle``'s combine rows and marks it received.

    Raises:
        RuntimeError: with ``debug_checks`` (``MOE_DBO_DEBUG_CHECKS=1``), a received count
            outside [0, C] (the ranks disagree on C, H or dtype, or a token names one expert
            twice).
    """
    num_ranks, hidden = blocks.shape[0], handle.hidden
    capacity, num_local = handle.num_max_dispatch_tokens_per_rank, handle.num_experts // num_ranks
    block = BlockLayout.of(
        capacity, handle.topk_shape[1], num_local, hidden, recv_rows.element_size()
    )
    recv_slot = slot_order(rank, num_ranks, own_first=True, device=recv_rows.device)
    layout = block.counts(blocks)[recv_slot]  # source-rank order
    if debug_checks and bool(((layout < 0) | (layout > capacity)).any()):  # host sync
        raise RuntimeError(
            f"low_latency_dispatch on rank {rank}: received row counts {layout.tolist()} "
            f"outside [0, {capacity}]: the ranks disagree on num_max_dispatch_tokens_per_rank, "
            f"hidden or dtype"
        )
    layout = layout.clamp(min=0)  # keeps every index in range whatever arrived
    local_expert, packed_row, is_valid = received_rows(layout, capacity, block.num_rows)
    src = torch.arange(num_ranks, device=layout.device).unsqueeze(1)
    src_rows = block.flat_row(recv_slot[src], torch.arange(block.num_rows, device=src.device))
    recv_row = local_expert * (num_ranks * capacity) + packed_row
    dst_row = torch.where(is_valid, recv_row, scratch_row(recv_rows)).view(-1)
    recv_rows.index_copy_(0, dst_row, blocks.reshape(-1, hidden).index_select(0, src_rows.view(-1)))
    recv_count.copy_(layout.clamp(max=capacity).sum(0))
    handle.recv_layout.copy_(layout.clamp(max=capacity))
    # the combine's rows: the source's send slot, then DeepEP's [L, C] (expert, token) layout
    token = block.src_token_idx(blocks)[recv_slot].clamp(0, capacity - 1)
    send_slot = slot_order(rank, num_ranks, own_first=False, device=src.device)[src]
    combine_row = (send_slot * num_local + local_expert) * capacity + token
    num_combine_rows = (2 * num_ranks - 1) * num_local * capacity  # its scratch row
    handle.combine_src_row.copy_(torch.where(is_valid, recv_row, 0).view(-1))
    handle.combine_dst_row.copy_(torch.where(is_valid, combine_row, num_combine_rows).view(-1))
    handle.is_received.set()


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
    if tuple(topk_idx.shape) != handle.topk_shape or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_idx {list(topk_idx.shape)} / topk_weights {list(topk_weights.shape)} must "
            f"be the dispatched {list(handle.topk_shape)}"
        )
    if not handle.is_received.is_set():
        raise ValueError("low_latency_combine before the dispatch's receive hook ran")


def pack_combine(x: Tensor, handle: LowLatencyHandle, *, num_ranks: int) -> Tensor:
    """``buf [2R - 1, L * C, H]`` x's dtype: ``buf[:R]`` one block per source rank (``slot_order``
    send side) of the rows of ``x [L, R * C, H]`` it sent, at ``(local expert, its token)``;
    ``buf[R:]`` for the peers' blocks (rows no token selected are unspecified)."""
    num_local, capacity = x.shape[0], handle.num_max_dispatch_tokens_per_rank
    buf, rows = block_buffer(2 * num_ranks - 1, num_local * capacity, x)
    outputs = x.reshape(-1, handle.hidden).index_select(0, handle.combine_src_row)
    rows.index_copy_(0, handle.combine_dst_row, outputs)
    return buf


def combine_link_bytes(handle: LowLatencyHandle, x: Tensor, rank: int) -> int:
    """Bytes DeepEP's combine puts on the wire: the rows going back to other ranks. Host sync
    (small): only an emulated link needs it."""
    num_back = handle.recv_layout.sum(1)
    num_send = int(num_back.sum() - num_back[rank])
    return num_send * handle.hidden * x.element_size()


def weighted_sum(
    blocks: Tensor,
    handle: LowLatencyHandle,
    topk_idx: Tensor,
    topk_weights: Tensor,
    combined_x: Tensor,
    *,
    rank: int,
) -> None:
    """The combine's hook work: ``combined_x [T, H] = sum_k topk_weights[t, k] * row(t, k)``
    over the received ``blocks [R, L * C, H]`` (``slot_order`` receive side), ``row(t, k)`` the
    row ``(e % L, t)`` of the block from expert ``e = topk_idx[t, k]``'s rank; in float32
    (float64 for float64)."""
    num_ranks, (num_tokens, hidden) = blocks.shape[0], combined_x.shape
    num_local, capacity = handle.num_experts // num_ranks, handle.num_max_dispatch_tokens_per_rank
    recv_slot = slot_order(rank, num_ranks, own_first=True, device=blocks.device)
    expert = topk_idx.clamp(min=0)
    token = torch.arange(num_tokens, device=blocks.device).unsqueeze(1)
    row = (recv_slot[expert // num_local] * num_local + expert % num_local) * capacity + token
    acc_dtype = accumulation_dtype(blocks.dtype)
    picked = blocks.reshape(-1, hidden).index_select(0, row.view(-1))
    picked = picked.view(*topk_idx.shape, hidden).to(acc_dtype)
    weighted = picked * topk_weights.to(acc_dtype).unsqueeze(-1)
    # a pair with no expert read an unspecified row: it adds exactly 0
    weighted = torch.where((topk_idx >= 0).unsqueeze(-1), weighted, 0.0)
    combined_x.copy_(weighted.sum(1))
