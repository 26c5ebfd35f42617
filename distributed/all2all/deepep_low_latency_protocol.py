"""DeepEP's low-latency protocol over torch.distributed (``low_latency_dispatch`` /
``low_latency_combine``), mixed into ``TorchDistributedBuffer``.

Legend: R = num_ranks, E = num_experts, L = E // R local experts, C = the call's
``num_max_dispatch_tokens_per_rank`` (capacity), H = hidden, T = num_tokens, K = num_topk,
B = C * min(K, L): the most rows one rank can send to another (a token's top-k experts are
distinct, so at most min(K, L) of them live on one rank).

Dispatch: a token goes once to each of its top-k experts (not once per rank, as in HT). What the
receiver gets is DeepEP's: ``recv_x [L, R * C, H]``, local expert l's rows from source rank r at
``recv_x[l, offset[r, l] : offset[r, l] + n[r, l]]`` (``offset`` the exclusive cumulative sum over
source ranks: valid rows packed to the front) and ``recv_count [L]``, valid after the hook. NO
count exchange: the counts travel IN the payload. Each rank sends every peer one block of a size
both sides know without a message, ``[L * 8 B counts | B rows]``, its rows for that peer packed
expert-major (expert l's n[l] rows after those of experts < l); ONE ``all_to_all_single`` of
these blocks, in flight until the hook unpacks them. A block holds at most B rows, where DeepEP's
fixed slots hold L * C, and only peers' blocks go through the process group: the rank's own rows
stay in memory (DeepEP copies them locally too).

Combine: the reverse with exact sizes, again without a message: a rank returns to each source
exactly the rows it received from it (known after the dispatch's hook), and the source expects
exactly the rows it sent. It sums ``topk_weights[t, k] * row`` over its token's top-k (DeepEP's LL
combine applies the weights).

Buffers put the blocks to send first, the rank's own block in the middle and the received blocks
after it, so the send part, the receive part and "own block + received blocks" are each one
contiguous slice (no copy of the own rows). A transfer's ``CommTiming.num_bytes`` is what DeepEP's
kernels would put on the wire (what an emulated link bills): valid rows to other ranks, plus the
counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from distributed.all2all.deepep_events import EmulatedEventOverlap, EmulatedTransfer
from distributed.all2all.deepep_low_latency_layout import (
    BlockLayout,
    exclusive_cumsum,
    expert_positions,
    peer_splits,
    slot_order,
    valid_rows,
)
from distributed.collectives import all_to_all_single
from distributed.comm_handle import CommTiming


@dataclass(frozen=True, slots=True, kw_only=True)
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from ``low_latency_dispatch`` (DeepEP's handle tuple).

    Attributes:
        num_max_dispatch_tokens_per_rank: the call's capacity C.
        hidden: H. num_experts: E.
        pair_row: ``[T, K]`` torch.int64, the row of each (token, top-k slot)'s expert output in
            the combine's receive view (own rows first, then each other rank's in rank order);
            -1 = no expert selected.
        num_sent_rows: per rank, the rows this rank sent it (= the rows combine gets back).
        recv_layout: ``[R, L]`` torch.int64 rows received from each source rank per local expert
            (DeepEP's layout range); written by the dispatch's hook.
        is_received: ``[1]`` torch.bool, set by the dispatch's hook once ``recv_layout`` holds.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    pair_row: Tensor
    num_sent_rows: tuple[int, ...]
    recv_layout: Tensor
    is_received: Tensor


class LowLatencyProtocol:
    """The two LL methods of ``TorchDistributedBuffer`` (uses its group, rank, group_size,
    timeout and num_max_dispatch_tokens_per_rank)."""

    def _check_capacity(self, num_tokens: int, capacity: int) -> None:
        allocated = self.num_max_dispatch_tokens_per_rank
        if capacity < 1 or (allocated and capacity > allocated):
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank={capacity} must be in [1, {allocated}] (the "
                f"capacity this buffer was sized for)"
            )
        if num_tokens > capacity:
            raise ValueError(
                f"low_latency_dispatch of {num_tokens} tokens exceeds "
                f"num_max_dispatch_tokens_per_rank={capacity}"
            )

    def low_latency_dispatch(
        self,
        x: Tensor,
        topk_idx: Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Tensor | None = None,
        dispatch_wait_recv_cost_stats: Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Tensor, Tensor, LowLatencyHandle, EmulatedEventOverlap, EmulatedTransfer | None]:
        """Send each (token, expert) pair to the expert's rank (see the module docstring).

        Args:
            x: ``[T, H]`` floating (DeepEP: bfloat16), ``T <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[T, K]`` int64 global expert ids, distinct per token, -1 = none.
            num_max_dispatch_tokens_per_rank: C, the same on every rank.
            use_fp8: must be False (the emulation carries ``x``'s dtype).

        Returns:
            ``recv_x [L, R * C, H]`` (x's dtype; only the first ``recv_count[l]`` rows of each
            expert are valid), ``recv_count [L]`` torch.int32, ``handle``, ``event``, ``hook``.
            With ``return_recv_hook`` the call only issues the transfer: the tensors are valid
            after ``hook()``; otherwise at return. ``hook`` is None without it.

        Raises:
            ValueError: ``use_fp8`` / FP8 options, T above C, C above the buffer's capacity, a
                token naming one expert twice.
        """
        if use_fp8 or round_scale or use_ue8m0:
            raise ValueError("the emulated buffer carries x's dtype: use_fp8 must be False")
        capacity = num_max_dispatch_tokens_per_rank
        self._check_capacity(x.shape[0], capacity)
        buf, handle, num_bytes = self._pack_dispatch(x, topk_idx, capacity, num_experts)
        num_ranks, num_local = self.group_size, num_experts // self.group_size
        recv_x = torch.empty(
            num_local, num_ranks * capacity, x.shape[1], dtype=x.dtype, device=x.device
        )
        recv_count = torch.zeros(num_local, dtype=torch.int32, device=x.device)

        def finish() -> None:
            self._unpack_dispatch(buf[num_ranks - 1 :], handle, recv_x, recv_count)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count)

        peers = peer_splits([1] * num_ranks, self.rank)
        transfer = self._issue(
            "deepep_low_latency dispatch",
            buf[num_ranks:],
            buf[: num_ranks - 1],
            (peers, peers),
            finish,
            num_bytes,
            return_recv_hook,
        )
        hook = transfer if return_recv_hook else None
        return recv_x, recv_count, handle, EmulatedEventOverlap(transfer), hook

    def _issue(
        self,
        op: str,
        recv: Tensor,
        send: Tensor,
        splits: tuple[list[int], list[int]],
        finish: Callable[[], None],
        num_bytes: int,
        return_recv_hook: bool,
    ) -> EmulatedTransfer:
        """Issue the call's ``all_to_all_single`` of ``send`` into ``recv`` (``splits``: input,
        output) as an ``EmulatedTransfer`` (``num_bytes``: what DeepEP's kernels put on the wire,
        see the module docstring), complete unless ``return_recv_hook``."""
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv, send, output_split_sizes=splits[1], input_split_sizes=splits[0], group=self.group
        )
        transfer = EmulatedTransfer(
            op=op,
            rank=self.rank,
            timeout=self.timeout,
            pending=pending,
            finish=finish,
            timing=CommTiming(issued_at_ns=issued_at_ns, num_bytes=num_bytes),
        )
        if not return_recv_hook:
            transfer.wait()  # blocking wait (timeout: self.timeout): the data must be there
        return transfer

    def _pack_dispatch(
        self, x: Tensor, topk_idx: Tensor, capacity: int, num_experts: int
    ) -> tuple[Tensor, LowLatencyHandle, int]:
        """``(buf [2R - 1, rows_per_block, H] x's dtype, handle, billed bytes)``: ``buf[:R]``
        holds one block per destination (``slot_order`` send side: peers, then this rank),
        ``buf[R:]`` receives the peers' blocks (layout: ``BlockLayout``).

        Raises:
            ValueError: more than B rows for one rank (only possible with repeated expert ids).
        """
        (num_tokens, hidden), num_ranks = x.shape, self.group_size
        num_local, device = num_experts // num_ranks, x.device
        block = BlockLayout.of(capacity, topk_idx.shape[1], num_local, hidden, x.element_size())
        per_expert, position = expert_positions(topk_idx, num_experts)
        sent = per_expert.view(num_ranks, num_local)
        num_sent_rows = sent.sum(1).tolist()  # host sync (small): the combine's split sizes
        if num_sent_rows and max(num_sent_rows) > block.num_rows:
            raise ValueError(
                f"low_latency_dispatch on rank {self.rank}: {max(num_sent_rows)} rows for one "
                f"rank exceed {block.num_rows} = capacity * min(num_topk, num_local_experts): "
                f"a token names the same expert twice"
            )
        buf = torch.empty(
            2 * num_ranks - 1, block.rows_per_block, hidden, dtype=x.dtype, device=device
        )
        send_slot = slot_order(self.rank, num_ranks, own_first=False, device=device)
        block.counts(buf)[:num_ranks].index_copy_(0, send_slot, sent)
        valid = position >= 0
        expert = topk_idx[valid]
        token = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(valid)[valid]
        dest, block_row = expert // num_local, exclusive_cumsum(sent, 1).view(-1)[expert]
        block_row = block_row + position[valid]
        buf.view(-1, hidden).index_copy_(
            0, block.flat_row(send_slot[dest], block_row), x.index_select(0, token)
        )
        # combine's receive view: own rows first, then every other rank's in rank order
        recvslot_order = [self.rank] + [p for p in range(num_ranks) if p != self.rank]
        chunk_start = torch.zeros(num_ranks, dtype=torch.int64, device=device)
        chunk_start[recvslot_order] = exclusive_cumsum(sent.sum(1)[recvslot_order], 0)
        pair_row = torch.full_like(topk_idx, -1)
        pair_row[valid] = chunk_start[dest] + block_row
        handle = LowLatencyHandle(
            num_max_dispatch_tokens_per_rank=capacity,
            hidden=hidden,
            num_experts=num_experts,
            pair_row=pair_row,
            num_sent_rows=tuple(num_sent_rows),
            recv_layout=torch.zeros(num_ranks, num_local, dtype=torch.int64, device=device),
            is_received=torch.zeros(1, dtype=torch.bool),
        )
        # bill what DeepEP puts on the wire: the valid rows for other ranks, and the counts
        num_remote = sum(num_sent_rows) - num_sent_rows[self.rank]
        num_bytes = num_remote * hidden * x.element_size() + (num_ranks - 1) * 8 * num_local
        return buf, handle, num_bytes

    def _unpack_dispatch(
        self, blocks: Tensor, handle: LowLatencyHandle, recv_x: Tensor, recv_count: Tensor
    ) -> None:
        """The hook's work: ``blocks [R, rows_per_block, H]`` (``slot_order`` receive side: own
        block, then the peers') into DeepEP's layout ``recv_x`` / ``recv_count``.

        Raises:
            RuntimeError: a received count outside [0, C] (the ranks disagree on C, H or dtype).
        """
        num_ranks, (num_local, num_slots, hidden) = self.group_size, recv_x.shape
        capacity = handle.num_max_dispatch_tokens_per_rank
        block = BlockLayout.of(
            capacity, handle.pair_row.shape[1], num_local, hidden, recv_x.element_size()
        )
        recv_slot = slot_order(self.rank, num_ranks, own_first=True, device=recv_x.device)
        layout = block.counts(blocks)[recv_slot]  # source-rank order
        if bool(((layout < 0) | (layout > capacity)).any()):  # host sync (small)
            raise RuntimeError(
                f"low_latency_dispatch on rank {self.rank}: received row counts "
                f"{layout.tolist()} outside [0, {capacity}]: the ranks disagree on "
                f"num_max_dispatch_tokens_per_rank, hidden or dtype"
            )
        rank, local_expert, _, block_row, packed_row = valid_rows(layout, capacity)
        rows = blocks.reshape(-1, hidden).index_select(
            0, block.flat_row(recv_slot[rank], block_row)
        )
        recv_x.view(-1, hidden).index_copy_(0, local_expert * num_slots + packed_row, rows)
        recv_count.copy_(layout.sum(0))
        handle.recv_layout.copy_(layout)
        handle.is_received.fill_(True)

    def low_latency_combine(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Tensor | None = None,
        combine_wait_recv_cost_stats: Tensor | None = None,
    ) -> tuple[Tensor, EmulatedEventOverlap, EmulatedTransfer | None]:
        """Send each expert output row back and reduce it WITH the top-k weights.

        Args:
            x: ``[L, R * C, H]`` expert outputs (unweighted), rows as ``low_latency_dispatch``
                delivered them; rows past ``recv_count`` are ignored.
            topk_idx: ``[T, K]`` int64, the dispatched ids. topk_weights: ``[T, K]`` float.
            handle: from ``low_latency_dispatch`` (whose hook must have run).
            out: optional ``[T, H]`` result tensor.

        Returns:
            ``(combined_x [T, H] x's dtype, event, hook)``: valid after ``hook()`` with
            ``return_recv_hook``, else at return. The sum accumulates in float32 (float64 for
            float64 inputs).

        Raises:
            ValueError: shapes that do not match the handle, or the dispatch's hook never ran.
        """
        self._check_combine(x, topk_idx, topk_weights, handle)
        buf, num_send, num_bytes, splits = self._pack_combine(x, handle)
        num_tokens, hidden = topk_idx.shape[0], handle.hidden
        num_own = handle.num_sent_rows[self.rank]
        combined_x = out if out is not None else torch.empty(num_tokens, hidden, dtype=x.dtype)
        transfer = self._issue(
            "deepep_low_latency combine",
            buf[num_send + num_own :],
            buf[:num_send],
            splits,
            lambda: self._weighted_sum(buf[num_send:], handle, topk_weights, combined_x),
            num_bytes,
            return_recv_hook,
        )
        return combined_x, EmulatedEventOverlap(transfer), transfer if return_recv_hook else None

    @staticmethod
    def _weighted_sum(
        rows: Tensor, handle: LowLatencyHandle, topk_weights: Tensor, combined_x: Tensor
    ) -> None:
        """The combine's hook work: ``combined_x [T, H] = sum_k topk_weights[t, k] * row(t, k)``
        over the received ``rows`` (own rows first, then each peer's: ``handle.pair_row``),
        accumulated in float32 (float64 for float64)."""
        if rows.shape[0] == 0:  # no (token, expert) pair anywhere: nothing came back
            combined_x.zero_()
            return
        acc_dtype = torch.promote_types(rows.dtype, torch.float32)
        num_tokens, hidden = combined_x.shape
        # each token's K rows (a pair with no expert reads row 0 with weight 0)
        picked = rows.index_select(0, handle.pair_row.clamp(min=0).view(-1))
        picked = picked.view(num_tokens, -1, hidden).to(acc_dtype)
        weights = torch.where(handle.pair_row >= 0, topk_weights.to(acc_dtype), 0.0)
        combined_x.copy_((picked * weights.unsqueeze(-1)).sum(1))

    def _check_combine(
        self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: LowLatencyHandle
    ) -> None:
        capacity, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
        num_ranks = self.group_size
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

    def _pack_combine(
        self, x: Tensor, handle: LowLatencyHandle
    ) -> tuple[Tensor, int, int, tuple[list[int], list[int]]]:
        """``(buf [rows, H] x's dtype, num_send, billed bytes, (input splits, output splits))``:
        ``buf[:num_send]`` the rows for the peers (rank order), then this rank's own rows, then
        the peers' rows coming back; ``buf[num_send:]`` is ``handle.pair_row``'s view."""
        layout, num_ranks = handle.recv_layout, self.group_size
        num_back = layout.sum(1).tolist()  # host sync (small): rows to return to each rank
        num_send = sum(num_back) - num_back[self.rank]
        num_recv = sum(handle.num_sent_rows) - handle.num_sent_rows[self.rank]
        buf = torch.empty(sum(num_back) + num_recv, handle.hidden, dtype=x.dtype, device=x.device)
        send_slot = slot_order(self.rank, num_ranks, own_first=False, device=x.device)
        back = torch.tensor(num_back, dtype=torch.int64, device=x.device)
        chunk_start = exclusive_cumsum(back[send_slot.argsort()], 0)[send_slot]
        rank, local_expert, _, block_row, packed_row = valid_rows(
            layout, handle.num_max_dispatch_tokens_per_rank
        )
        rows = x.reshape(-1, handle.hidden).index_select(0, local_expert * x.shape[1] + packed_row)
        buf.index_copy_(0, chunk_start[rank] + block_row, rows)
        splits = (
            peer_splits(num_back, self.rank),
            peer_splits(list(handle.num_sent_rows), self.rank),
        )
        num_bytes = num_send * handle.hidden * x.element_size()
        return buf, num_send, num_bytes, splits
