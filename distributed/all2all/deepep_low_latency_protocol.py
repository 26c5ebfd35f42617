"""DeepEP's low-latency protocol over torch.distributed (``low_latency_dispatch`` /
``low_latency_combine``), mixed into ``TorchDistributedBuffer``.

Legend: R = num_ranks, E = num_experts, L = E // R local experts, C = the call's
``num_max_dispatch_tokens_per_rank`` (capacity), H = hidden, T = num_tokens, K = num_topk.

Dispatch: a token goes once to each of its top-k experts (not once per rank, as in HT). Each rank
owns, in every peer's receive buffer, C rows per local expert of that peer, so the send buffer is
``[R, L * 8 B counts | L * C * H values]``: fixed-size blocks, ONE ``all_to_all_single`` with
equal splits and no count exchange (the counts travel in the blocks). The hook unpacks: local
expert l's rows from source rank r land at ``recv_x[l, offset[r, l] : offset[r, l] + n[r, l]]``,
``offset`` being the exclusive cumulative sum over source ranks (valid rows packed to the front).
Combine: the reverse, one fixed-size ``[R, L * C * H]`` block per source rank; the source rank
sums ``topk_weights[t, k] * row`` over its token's top-k (DeepEP's LL combine applies the weights).

The emulated link bills the rows DeepEP's kernels would put on the wire (valid rows to other
ranks, plus the counts); gloo itself moves the whole fixed-capacity buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from distributed.all2all.deepep_events import EmulatedEventOverlap, EmulatedTransfer
from distributed.collectives import all_to_all_single


@dataclass(frozen=True, slots=True, kw_only=True)
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from ``low_latency_dispatch`` (DeepEP's handle tuple).

    Attributes:
        num_max_dispatch_tokens_per_rank: the call's capacity C.
        hidden: H. num_experts: E.
        pair_slot: ``[T, K]`` torch.int64, each (token, top-k slot)'s row in the sender's
            ``[E * C]`` rows (expert-major); -1 = no expert selected.
        recv_layout: ``[R, L]`` torch.int64 rows received from each source rank per local expert
            (DeepEP's layout range); written by the dispatch's hook.
        is_received: ``[1]`` torch.bool, set by the dispatch's hook once ``recv_layout`` holds.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    pair_slot: Tensor
    recv_layout: Tensor
    is_received: Tensor


def _align8(num_bytes: int) -> int:
    return (num_bytes + 7) // 8 * 8


def _pair_slots(topk_idx: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, Tensor]:
    """``(pair_slot [T, K] int64, num_tokens_per_expert [E] int64)``: a pair's slot is
    ``expert * capacity + position``, the position counting earlier tokens sent to that expert."""
    flat = topk_idx.reshape(-1)
    expert = torch.where(flat >= 0, flat, num_experts)  # -1 -> an extra bucket, dropped below
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts + 1)
    starts = counts.cumsum(0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[expert[order]]
    slot = torch.where(flat >= 0, expert * capacity + position, -1)
    return slot.view(topk_idx.shape), counts[:num_experts]


def _valid_rows(layout: Tensor, capacity: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For ``layout [R, L]`` row counts: ``(rank, local_expert, row_in_block, packed_row)`` of
    every valid row, ``packed_row`` = its row in ``recv_x[local_expert]`` (source-rank order)."""
    offsets = layout.cumsum(0) - layout
    row = torch.arange(capacity, device=layout.device)
    rank, local_expert, row_in_block = (row < layout.unsqueeze(-1)).nonzero(as_tuple=True)
    return rank, local_expert, row_in_block, offsets[rank, local_expert] + row_in_block


class LowLatencyProtocol:
    """The two LL methods of ``TorchDistributedBuffer`` (uses its group, rank, group_size,
    timeout, link and num_max_dispatch_tokens_per_rank)."""

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
        """Send each (token, expert) pair into the expert's fixed slot on its rank.

        Args:
            x: ``[T, H]`` floating (DeepEP: bfloat16), ``T <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[T, K]`` int64 global expert ids, -1 = none.
            num_max_dispatch_tokens_per_rank: C, the same on every rank.
            use_fp8: must be False (the emulation carries ``x``'s dtype).

        Returns:
            ``recv_x [L, R * C, H]`` (x's dtype; only the first ``recv_count[l]`` rows of each
            expert are valid), ``recv_count [L]`` torch.int32, ``handle``, ``event``, ``hook``.
            With ``return_recv_hook`` the call only issues the transfer: the tensors are valid
            after ``hook()``; otherwise at return. ``hook`` is None without it.

        Raises:
            ValueError: ``use_fp8`` / FP8 options, T above C, C above the buffer's capacity.
        """
        if use_fp8 or round_scale or use_ue8m0:
            raise ValueError("the emulated buffer carries x's dtype: use_fp8 must be False")
        num_tokens, hidden = x.shape
        capacity = num_max_dispatch_tokens_per_rank
        self._check_capacity(num_tokens, capacity)
        num_ranks, device, dtype = self.group_size, x.device, x.dtype
        num_local = num_experts // num_ranks
        pair_slot, per_expert = _pair_slots(topk_idx, num_experts, capacity)
        counts_bytes, rows_bytes = 8 * num_local, num_local * capacity * hidden * x.element_size()
        block_bytes = counts_bytes + _align8(rows_bytes)
        send = torch.empty(num_ranks, block_bytes, dtype=torch.uint8, device=device)
        send[:, :counts_bytes].view(torch.int64).copy_(per_expert.view(num_ranks, num_local))
        send_rows = send[:, counts_bytes : counts_bytes + rows_bytes].view(dtype)
        send_rows = send_rows.view(num_ranks, num_local * capacity, hidden)
        valid = pair_slot >= 0
        slots = pair_slot[valid]
        token = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(pair_slot)[valid]
        block = num_local * capacity
        send_rows[slots // block, slots % block] = x[token]
        recv = torch.empty_like(send)
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv, send, output_split_sizes=None, input_split_sizes=None, group=self.group
        )
        recv_x = torch.empty(num_local, num_ranks * capacity, hidden, dtype=dtype, device=device)
        recv_count = torch.zeros(num_local, dtype=torch.int32, device=device)
        handle = LowLatencyHandle(
            num_max_dispatch_tokens_per_rank=capacity, hidden=hidden, num_experts=num_experts,
            pair_slot=pair_slot,
            recv_layout=torch.zeros(num_ranks, num_local, dtype=torch.int64, device=device),
            is_received=torch.zeros(1, dtype=torch.bool),
        )  # fmt: skip

        def finish() -> None:
            layout = recv[:, :counts_bytes].view(torch.int64)
            if bool(((layout < 0) | (layout > capacity)).any()):  # host sync (small)
                raise RuntimeError(
                    f"low_latency_dispatch on rank {self.rank}: received row counts "
                    f"{layout.tolist()} outside [0, {capacity}]: the ranks disagree on "
                    f"num_max_dispatch_tokens_per_rank, hidden or dtype"
                )
            rows = recv[:, counts_bytes : counts_bytes + rows_bytes].view(dtype)
            rows = rows.view(num_ranks, num_local, capacity, hidden)
            rank, local_expert, row_in_block, packed_row = _valid_rows(layout, capacity)
            recv_x[local_expert, packed_row] = rows[rank, local_expert, row_in_block]
            recv_count.copy_(layout.sum(0))
            handle.recv_layout.copy_(layout)
            handle.is_received.fill_(True)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count)

        # bill what DeepEP puts on the wire: the valid rows for other ranks, and the counts
        num_remote = int(valid.sum()) - int(per_expert.view(num_ranks, -1)[self.rank].sum())
        num_bytes = num_remote * hidden * x.element_size() + (num_ranks - 1) * counts_bytes
        transfer = EmulatedTransfer(
            op="deepep_low_latency dispatch", rank=self.rank, timeout=self.timeout,
            pending=pending, finish=finish, issued_at_ns=issued_at_ns, num_bytes=num_bytes,
            link=self.link,
        )  # fmt: skip
        if not return_recv_hook:
            transfer.wait()  # blocking wait (timeout: self.timeout): the data must be there
        hook = transfer if return_recv_hook else None
        return recv_x, recv_count, handle, EmulatedEventOverlap(transfer), hook

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
        capacity, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
        num_ranks, device, dtype = self.group_size, x.device, x.dtype
        num_local = handle.num_experts // num_ranks
        if x.shape != (num_local, num_ranks * capacity, hidden):
            raise ValueError(
                f"low_latency_combine x must be [{num_local}, {num_ranks * capacity}, {hidden}], "
                f"got {list(x.shape)}"
            )
        if topk_idx.shape != handle.pair_slot.shape or topk_weights.shape != topk_idx.shape:
            raise ValueError(
                f"topk_idx {list(topk_idx.shape)} / topk_weights {list(topk_weights.shape)} must "
                f"be the dispatched {list(handle.pair_slot.shape)}"
            )
        if not bool(handle.is_received):
            raise ValueError("low_latency_combine before the dispatch's receive hook ran")
        rows_bytes = num_local * capacity * hidden * x.element_size()
        send = torch.empty(num_ranks, _align8(rows_bytes), dtype=torch.uint8, device=device)
        send_rows = send[:, :rows_bytes].view(dtype).view(num_ranks, num_local, capacity, hidden)
        layout = handle.recv_layout
        rank, local_expert, row_in_block, packed_row = _valid_rows(layout, capacity)
        send_rows[rank, local_expert, row_in_block] = x[local_expert, packed_row]
        recv = torch.empty_like(send)
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv, send, output_split_sizes=None, input_split_sizes=None, group=self.group
        )
        num_tokens = topk_idx.shape[0]
        combined_x = out if out is not None else torch.empty(num_tokens, hidden, dtype=dtype)
        acc_dtype = torch.promote_types(dtype, torch.float32)

        def finish() -> None:
            rows = recv[:, :rows_bytes].view(dtype).reshape(handle.num_experts * capacity, hidden)
            valid = handle.pair_slot >= 0
            token = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(valid)[valid]
            weighted = rows[handle.pair_slot[valid]].to(acc_dtype) * (
                topk_weights[valid].to(acc_dtype).unsqueeze(1)
            )
            total = torch.zeros(num_tokens, hidden, dtype=acc_dtype, device=device)
            total.index_add_(0, token, weighted)
            combined_x.copy_(total)

        num_remote = int(layout.sum()) - int(layout[self.rank].sum())
        transfer = EmulatedTransfer(
            op="deepep_low_latency combine", rank=self.rank, timeout=self.timeout,
            pending=pending, finish=finish, issued_at_ns=issued_at_ns,
            num_bytes=num_remote * hidden * x.element_size(), link=self.link,
        )  # fmt: skip
        if not return_recv_hook:
            transfer.wait()  # blocking wait (timeout: self.timeout): the data must be there
        return combined_x, EmulatedEventOverlap(transfer), transfer if return_recv_hook else None
