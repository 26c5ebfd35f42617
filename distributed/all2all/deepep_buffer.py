"""DeepEP's two protocols over torch.distributed, behind the ``deep_ep.Buffer`` methods our adapters
call (``get_dispatch_layout``, ``dispatch``, ``combine``, ``low_latency_dispatch``,
``low_latency_combine``), with DeepEP's argument names, shapes and "valid when" rules.

Used where ``deep_ep`` cannot run (no CUDA device, or the package is missing): gloo on CPU, NCCL
on a GPU without DeepEP. It is real communication: every byte moves through the process group.

High throughput (HT), after DeepEP's intranode ``dispatch``:
  1. layout (local): ``num_tokens_per_rank``, ``num_tokens_per_expert``, ``is_token_in_rank``;
  2. notify: a small blocking ``all_to_all_single`` of the counts (DeepEP's CPU waits for them
     too: the receive sizes must be known on the host);
  3. payload: one uneven ``all_to_all_single`` of packed rows (token, LOCAL top-k ids, weights),
     in flight until the returned event is waited.
Low latency (LL), after DeepEP's ``low_latency_dispatch``: NO count exchange. A token goes once
to each of its top-k experts; one ``all_to_all_single`` of equal blocks, sized without a message
(``num_max_dispatch_tokens_per_rank * min(num_topk, num_local_experts)`` rows, the most one rank
can send another), carries each peer's rows packed per expert with the per-expert counts; with
``return_recv_hook=True`` the call only issues it, and the hook completes the receive (waits,
then places each local expert's rows at the front of ``recv_x``: DeepEP's layout
``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` + ``recv_count``).
Combine returns exactly the received rows (both sides know the counts after the dispatch).
Details in ``deepep_low_latency_protocol``.

On CPU there are no streams: ``EmulatedEventOverlap.current_stream_wait()`` and the hooks block
the calling thread until the data is there (bounded by the timeout), which is what the CUDA stream
wait means for the tensors' users. Differences from DeepEP: any floating dtype travels (no FP8
cast, ``use_fp8`` must be False), HT's ``config``/``expert_alignment``/cached ``handle`` arguments
are not supported, and LL rows are packed in (source rank, token) order, deterministically.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.deepep_events import EmulatedEventOverlap, EmulatedTransfer
from distributed.all2all.deepep_low_latency_protocol import LowLatencyProtocol
from distributed.all2all.token_packing import (
    RowLayout,
    localize_topk,
    pack_rows,
    token_rank_mask,
    unpack_rows,
)
from distributed.collectives import Pending, all_to_all_single
from distributed.comm_handle import CommTiming, wait_blocking_exchange

IMPLEMENTATION = "torch.distributed emulation of DeepEP's protocol"


@dataclass(frozen=True, slots=True, kw_only=True)
class HighThroughputHandle:
    """What ``combine`` needs from an HT ``dispatch`` (DeepEP's handle tuple, as named fields).

    Attributes:
        send_counts: rows this rank sent to each rank (= rows it gets back in combine).
        recv_counts: rows this rank received from each rank (= rows it returns in combine).
        send_token_idx: ``[sum(send_counts)]`` torch.int64 source token of each sent row.
        num_tokens: tokens this rank dispatched (rows of the combined result).
    """

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_token_idx: Tensor
    num_tokens: int


class TorchDistributedBuffer(LowLatencyProtocol):
    """Our ``deep_ep.Buffer`` over a torch.distributed group (see the module docstring).

    Args:
        group: the EP group (None: one rank, local copies).
        rank, num_ranks: this rank and the group size.
        timeout: limit of every blocking wait.
        num_max_dispatch_tokens_per_rank: the LL capacity this buffer was sized for (DeepEP sizes
            its RDMA buffer with it); a low-latency call may use up to this many.
    """

    implementation = IMPLEMENTATION

    def __init__(
        self,
        group: ProcessGroup | None,
        *,
        rank: int,
        num_ranks: int,
        timeout: datetime.timedelta,
        num_max_dispatch_tokens_per_rank: int = 0,
    ) -> None:
        self.group = group
        self.rank = rank
        self.group_size = num_ranks
        self.timeout = timeout
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank

    @staticmethod
    def capture() -> EmulatedEventOverlap:
        """An event on the current stream: on CPU everything before it has already run."""
        return EmulatedEventOverlap()

    # ------------------------------------------------------------------ high throughput

    def get_dispatch_layout(
        self,
        topk_idx: Tensor,
        num_experts: int,
        previous_event: EmulatedEventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, None, Tensor, Tensor, EmulatedEventOverlap]:
        """``(num_tokens_per_rank [num_ranks] int32, None, num_tokens_per_expert [num_experts]
        int32, is_token_in_rank [num_tokens, num_ranks] bool, event)`` of ``topk_idx``
        (``[num_tokens, num_topk]`` int64, -1 = no selection). Local computation only."""
        if previous_event is not None:
            previous_event.current_stream_wait()
        num_local_experts = num_experts // self.group_size
        is_token_in_rank = token_rank_mask(
            topk_idx, num_local_experts=num_local_experts, ep_size=self.group_size
        )
        valid = topk_idx[topk_idx >= 0]
        num_tokens_per_expert = torch.bincount(valid, minlength=num_experts).int()
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).int()
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, self.capture()

    def dispatch(
        self,
        x: Tensor,
        handle: HighThroughputHandle | None = None,
        num_tokens_per_rank: Tensor | None = None,
        num_tokens_per_rdma_rank: Tensor | None = None,
        is_token_in_rank: Tensor | None = None,
        num_tokens_per_expert: Tensor | None = None,
        topk_idx: Tensor | None = None,
        topk_weights: Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event: EmulatedEventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, list[int], HighThroughputHandle, EmulatedEventOverlap]:
        """Send each token once to every rank holding one of its experts (DeepEP HT).

        Args:
            x: ``[num_tokens, hidden]`` floating (DeepEP: bfloat16).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from
                ``get_dispatch_layout``.
            topk_idx: ``[num_tokens, num_topk]`` int64 global expert ids, -1 = none.
            topk_weights: ``[num_tokens, num_topk]`` float32.

        Returns:
            ``recv_x [num_recv_tokens, hidden]``, ``recv_topk_idx [num_recv_tokens, num_topk]``
            int64 LOCAL ids (-1 = not on this rank), ``recv_topk_weights`` float32 (0 where -1),
            ``num_recv_tokens_per_expert_list`` (host ints, per local expert), ``handle`` and
            ``event``. The tensors are valid only after ``event.current_stream_wait()`` when
            ``async_finish`` is set (else at return). Rows come in (source rank, token) order.

        Raises:
            ValueError: unsupported options or inputs missing; rank disagreement on the row format
                (raised on every rank). TimeoutError / RuntimeError: the notify step failed.
        """
        if (
            handle is not None
            or expert_alignment != 1
            or num_worst_tokens
            or None in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx)
        ):
            raise ValueError(
                "the emulated buffer's dispatch needs the layout tensors and topk_idx, and "
                "supports neither a cached handle, expert_alignment != 1 nor num_worst_tokens"
            )
        if previous_event is not None:
            previous_event.current_stream_wait()
        assert topk_idx is not None and is_token_in_rank is not None  # narrowed above
        return self._dispatch_rows(
            x,
            topk_idx,
            topk_weights,
            is_token_in_rank,
            num_tokens_per_rank,
            num_tokens_per_expert,
            async_finish,
        )

    def _dispatch_rows(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor | None,
        is_token_in_rank: Tensor,
        num_tokens_per_rank: Tensor,
        num_tokens_per_expert: Tensor,
        async_finish: bool,
    ) -> tuple[Tensor, Tensor, Tensor, list[int], HighThroughputHandle, EmulatedEventOverlap]:
        """``dispatch`` once its arguments are checked: notify, then the payload."""
        layout = RowLayout(hidden_size=x.shape[1], num_topk=topk_idx.shape[1], dtype=x.dtype)
        send_counts, recv_counts, num_recv_tokens_per_expert, notify_ns = self._notify_counts(
            num_tokens_per_rank, num_tokens_per_expert, layout
        )
        send_rank, send_token_idx = is_token_in_rank.t().nonzero(as_tuple=True)
        packed = self._pack_ht_rows(
            x, topk_idx, topk_weights, send_rank, send_token_idx, num_tokens_per_expert.numel()
        )
        recv, event = self._issue_ht_rows(packed, send_counts, recv_counts, notify_ns, async_finish)
        recv_topk_idx, recv_topk_weights, recv_x = unpack_rows(recv, layout)
        new_handle = HighThroughputHandle(
            send_counts=tuple(send_counts),
            recv_counts=tuple(recv_counts),
            send_token_idx=send_token_idx,
            num_tokens=x.shape[0],
        )
        return (
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert,
            new_handle,
            event,
        )

    def _issue_ht_rows(
        self,
        packed: Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        notify_ns: tuple[int, int],
        async_finish: bool,
    ) -> tuple[Tensor, EmulatedEventOverlap]:
        """Issue HT's payload, the ``packed`` rows ``[sum(send_counts), row_bytes]`` uint8 in
        destination order; ``(recv [sum(recv_counts), row_bytes] uint8, event)``."""
        row_bytes = packed.shape[1]
        recv = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=packed.device)
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv,
            packed,
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self.group,
        )
        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(packed.shape[0] - send_counts[self.rank]) * row_bytes,
            num_recv_bytes=(recv.shape[0] - recv_counts[self.rank]) * row_bytes,
            notify_ns=notify_ns,
        )
        event = self._event("deepep_high_throughput dispatch", pending, None, timing, async_finish)
        return recv, event

    def _pack_ht_rows(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor | None,
        send_rank: Tensor,
        send_token_idx: Tensor,
        num_experts: int,
    ) -> Tensor:
        """The sent rows ``[len(send_token_idx), row_bytes]`` uint8: each (destination, token)
        pair's token with its top-k ids made local to the destination (weights 1 if None)."""
        weights = torch.ones_like(topk_idx, dtype=torch.float32)
        if topk_weights is not None:
            weights = topk_weights.float()
        layout = RowLayout(hidden_size=x.shape[1], num_topk=topk_idx.shape[1], dtype=x.dtype)
        local_ids, local_weights = localize_topk(
            topk_idx[send_token_idx],
            weights[send_token_idx],
            send_rank,
            num_local_experts=num_experts // self.group_size,
        )
        return pack_rows(x[send_token_idx], local_ids, local_weights, layout)

    def combine(
        self,
        x: Tensor,
        handle: HighThroughputHandle,
        topk_weights: Tensor | None = None,
        bias=None,
        config=None,
        previous_event: EmulatedEventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, None, EmulatedEventOverlap]:
        """Send each received row back and sum a token's rows over ranks (no weights: DeepEP HT).

        Args:
            x: ``[num_recv_tokens, hidden]`` in the dispatched dtype (cast to it if not).

        Returns:
            ``(combined_x [num_tokens, hidden], None, event)``; ``combined_x`` (summed in
            float32, float64 for float64 inputs; stored in ``x``'s dtype) is valid after the
            event when ``async_finish``.
        """
        if topk_weights is not None or bias is not None:
            raise ValueError("the emulated buffer's combine takes neither topk_weights nor bias")
        if x.dim() != 2 or x.shape[0] != sum(handle.recv_counts):
            raise ValueError(
                f"combine x must be [{sum(handle.recv_counts)}, hidden], got {list(x.shape)}"
            )
        if previous_event is not None:
            previous_event.current_stream_wait()
        send = x.contiguous().view(torch.uint8)
        num_back = sum(handle.send_counts)
        recv = torch.empty(num_back, send.shape[1], dtype=torch.uint8, device=x.device)
        combined_x = torch.empty(handle.num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv,
            send,
            output_split_sizes=list(handle.send_counts),
            input_split_sizes=list(handle.recv_counts),
            group=self.group,
        )

        def finish() -> None:
            acc_dtype = torch.promote_types(x.dtype, torch.float32)
            total = torch.zeros(combined_x.shape, dtype=acc_dtype, device=x.device)
            rows = recv.view(x.dtype).to(acc_dtype)
            total.index_add_(0, handle.send_token_idx.to(x.device), rows)
            combined_x.copy_(total)

        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(send.shape[0] - handle.recv_counts[self.rank]) * send.shape[1],
            num_recv_bytes=(num_back - handle.send_counts[self.rank]) * send.shape[1],
        )
        event = self._event("deepep_high_throughput combine", pending, finish, timing, async_finish)
        return combined_x, None, event

    # ------------------------------------------------------------------ shared helpers

    def _notify_counts(
        self, num_tokens_per_rank: Tensor, num_tokens_per_expert: Tensor, layout: RowLayout
    ) -> tuple[list[int], list[int], list[int], tuple[int, int]]:
        """DeepEP HT's notify: send each rank its row count, per-local-expert counts and the row
        format; ``(send_counts, recv_counts, num_recv_tokens_per_expert, notify_ns)``.

        Raises:
            ValueError: (on every rank) the ranks disagree on the row format.
        """
        num_local_experts = num_tokens_per_expert.numel() // self.group_size
        header = torch.cat(
            [
                num_tokens_per_rank.long().cpu().unsqueeze(1),
                num_tokens_per_expert.long().cpu().view(self.group_size, num_local_experts),
                torch.tensor([layout.signature()] * self.group_size, dtype=torch.int64),
            ],
            dim=1,
        )
        recv_header, notify_ns = self._notify(header)
        signatures = recv_header[:, -3:].tolist()
        if any(sig != list(layout.signature()) for sig in signatures):
            raise ValueError(
                f"deepep_high_throughput dispatch on rank {self.rank}: (hidden_size, num_topk, "
                f"dtype code) differ across EP ranks: {signatures}"
            )
        num_recv_tokens_per_expert = recv_header[:, 1 : 1 + num_local_experts].sum(0).tolist()
        return (
            header[:, 0].tolist(),
            recv_header[:, 0].tolist(),
            num_recv_tokens_per_expert,
            notify_ns,
        )

    def _notify(self, header: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Blocking ``all_to_all_single`` of one header row per rank (DeepEP's notify)."""
        recv_header = torch.empty_like(header)
        start_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv_header, header, output_split_sizes=None, input_split_sizes=None, group=self.group
        )
        transfer = EmulatedTransfer(
            op="deepep_high_throughput dispatch notify",
            rank=self.rank,
            timeout=self.timeout,
            pending=pending,
            finish=None,
            timing=CommTiming(
                issued_at_ns=start_ns, num_bytes=(self.group_size - 1) * header.shape[1] * 8
            ),
        )
        # blocking wait (timeout: self.timeout): the sizes must be on the host
        wait_blocking_exchange(transfer)
        return recv_header, (start_ns, time.perf_counter_ns())

    def _event(
        self,
        op: str,
        pending: Pending,
        finish: Callable[[], None] | None,
        timing: CommTiming,
        async_finish: bool,
    ) -> EmulatedEventOverlap:
        transfer = EmulatedTransfer(
            op=op,
            rank=self.rank,
            timeout=self.timeout,
            pending=pending,
            finish=finish,
            timing=timing,
        )
        if not async_finish:
            transfer.wait()  # blocking wait (timeout: self.timeout): a synchronous call
        return EmulatedEventOverlap(transfer)
