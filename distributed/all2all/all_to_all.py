"""``all_to_all``: each token once to every EP rank holding one of its experts, in ONE uneven
``all_to_all_single`` of packed rows (``token_packing``) after a blocking count exchange (DeepEP's
notify), or, for a small batch whose counts the DP ranks agreed on, one padded transfer without it
(``PADDED_DISPATCH_MAX_BYTES``); combine sends the outputs back the same way and sums them in token
order. Our DeepEP high-throughput emulation uses the same exchange functions.
docs/backends.md#what-each-sends."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.base import (
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    StandardDispatchMetadata,
    accumulation_dtype,
    complete_exchange,
)
from distributed.all2all.token_packing import (
    RowLayout,
    pack_sent_rows,
    unpack_row_ranges,
)
from distributed.collectives import Pending, all_to_all_single
from distributed.comm_handle import CommHandle, CommTiming
from distributed.communicator import Communicator
from distributed.link_emulation import EmulatedLink

PADDED_DISPATCH_MAX_BYTES = 256 << 10
_HEADER_INTS = 4  # a padded block's header row: (row count, hidden_size, num_topk, dtype code)


def issue_rows(
    send: Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    group: ProcessGroup | Communicator | None,
    rank: int,
    notify_ns: tuple[int, int] | None = None,
) -> tuple[Tensor, Pending, CommTiming]:
    """Issue ONE uneven ``all_to_all_single`` of ``send [sum(send_counts), width]`` (rows by
    destination); ``(recv [sum(recv_counts), width], pending, timing)``."""
    recv = send.new_empty(sum(recv_counts), send.shape[1])
    issued_at_ns = time.perf_counter_ns()
    pending = all_to_all_single(
        recv,
        send,
        output_split_sizes=list(recv_counts),
        input_split_sizes=list(send_counts),
        group=group,
    )
    row_bytes = send.shape[1] * send.element_size()
    timing = CommTiming(
        issued_at_ns=issued_at_ns,
        num_bytes=(send.shape[0] - send_counts[rank]) * row_bytes,
        num_recv_bytes=(recv.shape[0] - recv_counts[rank]) * row_bytes,
        notify_ns=notify_ns,
    )
    return recv, pending, timing


def exchange_counts(
    counts: Tensor,
    layout: RowLayout,
    *,
    op: str,
    group: ProcessGroup | Communicator | None,
    rank: int,
    timeout: datetime.timedelta,
    link: EmulatedLink | None,
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """DeepEP's notify: a blocking ``all_to_all_single`` sending EP rank r ``counts[r]``
    (``[ep_size, n]`` int) and the row format, behind ``link`` if any; ``(counts, received
    counts)`` on the host and the exchange's ``(start, end)`` ns.

    Raises:
        ValueError: (on every rank) the ranks disagree on the row format.
    """
    device, counts = counts.device, counts.long().cpu()  # host sync: splits are host ints
    num_ranks = counts.shape[0]
    signatures = torch.tensor([layout.signature()] * num_ranks, dtype=torch.int64)
    header = torch.cat([counts, signatures], dim=1).to(device)
    recv_header = torch.empty_like(header)
    start_ns = time.perf_counter_ns()
    pending = all_to_all_single(
        recv_header, header, output_split_sizes=None, input_split_sizes=None, group=group
    )
    notify_ns = complete_exchange(  # blocking wait (timeout): the splits must be on the host
        pending,
        op=op,
        rank=rank,
        timeout=timeout,
        num_bytes=(num_ranks - 1) * header.shape[1] * 8,
        start_ns=start_ns,
        link=link,
    )
    recv_header = recv_header.cpu()
    layout.check_signatures(recv_header[:, -3:].tolist(), op, rank)
    return counts, recv_header[:, :-3], notify_ns


def issue_combine(
    expert_output: Tensor,
    send_token_idx: Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    num_tokens: int,
    group: ProcessGroup | Communicator | None,
    rank: int,
) -> tuple[Pending, CommTiming, Callable[[], Tensor]]:
    """The reverse of a dispatch that sent ``send_counts`` rows and received ``recv_counts``:
    ``expert_output [sum(recv_counts), hidden]`` goes back as raw bytes (any dtype travels);
    ``(pending, timing, sum_rows)``, ``sum_rows()`` adding the rows that came back at
    ``send_token_idx`` into ``[num_tokens, hidden]`` (float32 sums) once they are there."""
    dtype, hidden = expert_output.dtype, expert_output.shape[1]
    send = expert_output.contiguous().view(torch.uint8)
    recv, pending, timing = issue_rows(send, recv_counts, send_counts, group=group, rank=rank)

    def sum_rows() -> Tensor:
        out = torch.zeros(num_tokens, hidden, dtype=accumulation_dtype(dtype), device=recv.device)
        out.index_add_(0, send_token_idx.to(recv.device), recv.view(dtype).to(out.dtype))
        return out.to(dtype)

    return pending, timing, sum_rows


def unpacked_result(
    rows: Tensor, layout: RowLayout, metadata, ranges: Sequence[tuple[int, int]] | None = None
) -> DispatchResult:
    """Received packed rows ``[num_recv, row_bytes]`` uint8 (those of ``ranges``, default all) as
    a ``DispatchResult``."""
    ids, weights, hidden = unpack_row_ranges(
        rows, layout, [(0, rows.shape[0])] if ranges is None else ranges
    )
    return DispatchResult(
        hidden_states=hidden, topk_ids=ids, topk_weights=weights, metadata=metadata
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AllToAllDispatchMetadata(StandardDispatchMetadata):
    """Routing of one ``all_to_all`` dispatch."""

    send_counts: tuple[int, ...]  # rows sent to each EP rank (= rows back in combine)
    recv_counts: tuple[int, ...]  # rows received from each EP rank (= rows it returns)
    send_token_idx: Tensor  # [sum(send_counts)] int64, the token of each sent row


class AllToAllPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """Uneven ``all_to_all_single`` dispatch / combine (see the module docstring)."""

    name = "all_to_all"
    activation_format = FusedMoEActivationFormat.Standard
    # the per-destination counts depend on the routing: the exchange stays when the token counts
    # are known, except for small padded dispatches
    blocks_under_dbo = True

    def prepare(self, request: DispatchRequest) -> CommHandle[DispatchResult]:
        layout, counts = request.layout, request.num_tokens_across_ep
        padded_bytes = self.ep_size * (1 + max(counts or [0])) * layout.row_bytes
        if counts is not None and padded_bytes <= PADDED_DISPATCH_MAX_BYTES:
            return self._prepare_padded(request)
        packed, send_counts, send_token_idx = self._pack(request)
        send_counts, recv_counts, notify_ns = exchange_counts(
            send_counts.unsqueeze(1),
            layout,
            op="all_to_all dispatch count exchange",
            group=self.ep_group,
            rank=self.ep_rank,
            timeout=self.timeout,
            link=self.link,
        )
        send_counts, recv_counts = send_counts[:, 0].tolist(), recv_counts[:, 0].tolist()
        recv, pending, timing = issue_rows(
            packed,
            send_counts,
            recv_counts,
            group=self.ep_group,
            rank=self.ep_rank,
            notify_ns=notify_ns,
        )
        metadata = self._routing(request, send_counts, recv_counts, send_token_idx)
        return self._handle(
            pending,
            lambda: unpacked_result(recv, layout, metadata),
            op="all_to_all dispatch",
            timing=timing,
        )

    def finalize(
        self, expert_output: Tensor, metadata: AllToAllDispatchMetadata
    ) -> CommHandle[Tensor]:
        pending, timing, sum_rows = issue_combine(
            expert_output.to(metadata.dtype),
            metadata.send_token_idx,
            metadata.send_counts,
            metadata.recv_counts,
            num_tokens=metadata.num_tokens,
            group=self.ep_group,
            rank=self.ep_rank,
        )
        return self._handle(pending, sum_rows, op="all_to_all combine", timing=timing)

    def _pack(self, request: DispatchRequest, *, block: int | None = None):
        return pack_sent_rows(
            request.hidden_states,
            request.topk_ids,
            request.topk_weights,
            request.layout,
            num_local_experts=self.num_local_experts,
            ep_size=self.ep_size,
            block=block,
        )

    def _routing(self, request, send_counts, recv_counts, send_token_idx):
        return self._metadata(
            AllToAllDispatchMetadata,
            request,
            num_recv_tokens=sum(recv_counts),
            send_counts=tuple(send_counts),
            recv_counts=tuple(recv_counts),
            send_token_idx=send_token_idx,
        )

    def _prepare_padded(self, request: DispatchRequest) -> CommHandle[DispatchResult]:
        """The dispatch without count exchange (module docstring): per peer a block of a header
        row (row count and row format, int64) and its packed rows, zero-padded to ``block``."""
        block = 1 + request.num_tokens  # rows this rank sends each peer
        send, send_counts, send_token_idx = self._pack(request, block=block)
        signature = torch.tensor(request.layout.signature(), dtype=torch.int64)
        header = torch.cat(  # on the device: no host read of the counts before the issue
            [send_counts[:, None], signature.to(send.device).expand(self.ep_size, -1)], dim=1
        )
        send.view(self.ep_size, block, -1)[:, 0, : 8 * _HEADER_INTS] = header.view(torch.uint8)
        recv_blocks = [1 + n for n in request.num_tokens_across_ep]
        recv, pending, timing = issue_rows(
            send, [block] * self.ep_size, recv_blocks, group=self.ep_group, rank=self.ep_rank
        )

        def finalize() -> DispatchResult:
            ranges = self._valid_rows(recv, recv_blocks, request.layout)
            recv_counts = [n for _, n in ranges]
            metadata = self._routing(request, send_counts.tolist(), recv_counts, send_token_idx)
            return unpacked_result(recv, request.layout, metadata, ranges)

        return self._handle(pending, finalize, op="all_to_all dispatch", timing=timing)

    def _valid_rows(self, recv: Tensor, recv_blocks: list[int], layout) -> list[tuple[int, int]]:
        """``(first row, row count)`` of each received block's packed rows (rank order), read
        from its header row (ValueError for another row format)."""
        starts = [sum(recv_blocks[:r]) for r in range(self.ep_size)]  # loop over ranks
        headers = recv[starts, : 8 * _HEADER_INTS].contiguous().view(torch.int64).tolist()
        layout.check_signatures([h[1:] for h in headers], "all_to_all dispatch", self.ep_rank)
        for rank, (h, block) in enumerate(zip(headers, recv_blocks, strict=True)):
            if not 0 <= h[0] < block:
                raise ValueError(
                    f"all_to_all dispatch on ep_rank {self.ep_rank}: ep_rank {rank}'s block "
                    f"header says {h[0]} rows, its block holds {block - 1}"
                )
        return [(start + 1, h[0]) for start, h in zip(starts, headers, strict=True)]  # host sync
