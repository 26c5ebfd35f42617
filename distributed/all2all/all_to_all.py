"""``all_to_all`` backend: uneven ``all_to_all_single`` of packed token rows.

Dispatch (DeepEP high-throughput layout): rows are ordered by destination rank, then by token
index; a token goes once to each rank holding one of its experts.
  1. count exchange: a small ``all_to_all_single`` of ``[ep_size, 4]`` int64 (rows for each peer,
     row format) — blocking, because the payload splits must be known on the host (DeepEP's
     "notify" step);
  2. payload: ONE uneven ``all_to_all_single`` of ``[num_send_rows, row_bytes]`` uint8.
Combine: the reverse uneven ``all_to_all_single`` of the expert outputs (in the dispatched dtype,
as DeepEP combines in bf16), then an fp32 ``index_add`` into token order.

Padded dispatch (no count exchange): when every rank's token count is known (the DP vote fixed
them: ``num_tokens_across_ep``) and the padded transfer is small (``PADDED_DISPATCH_MAX_BYTES``),
each rank sends every peer a fixed block of ``1 + num_tokens`` rows — a header row (row count and
row format, int64) and its rows for that peer, zero-padded — in ONE ``all_to_all_single`` whose
splits every rank knows. The receiver reads the counts from the header rows. On small batches the
blocking count exchange's round trip costs more than the padding (measured in docs/backends.md,
"What each sends"); on large ones the padding would cost more bytes than the exchange saves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from distributed.all2all.base import (
    DispatchMetadata,
    DispatchResult,
    StandardAll2AllBackend,
    StandardDispatchMetadata,
)
from distributed.all2all.token_packing import localize_topk, pack_rows, token_rank_mask, unpack_rows
from distributed.collectives import Pending, all_to_all_single
from distributed.comm_handle import CommHandle, CommTiming

# Padded dispatch when ep_size * (1 + max tokens per rank) * row_bytes is at most this: small
# batches of narrow rows (docs/backends.md, "What each sends").
PADDED_DISPATCH_MAX_BYTES = 256 << 10
_HEADER_INTS = 4  # header row: (row count, hidden_size, num_topk, dtype code) as int64


def unpacked_result(rows: Tensor, layout, metadata: DispatchMetadata) -> DispatchResult:
    """The received packed rows ``[num_recv, row_bytes]`` uint8 as a ``DispatchResult``
    (hidden states, local top-k ids and weights, each contiguous)."""
    ids, weights, hidden = unpack_rows(rows, layout)
    return DispatchResult(
        hidden_states=hidden.contiguous(),
        topk_ids=ids.contiguous(),
        topk_weights=weights.contiguous(),
        metadata=metadata,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AllToAllDispatchMetadata(StandardDispatchMetadata):
    """Routing of one ``all_to_all`` dispatch.

    Attributes:
        send_counts: rows this rank sent to each EP rank (= rows it gets back in combine).
        recv_counts: rows this rank received from each EP rank (= rows it returns in combine).
        send_token_idx: ``[sum(send_counts)]`` torch.int64, the source token of each sent row, in
            send order (by destination rank, then token index).
    """

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_token_idx: Tensor


class AllToAllBackend(StandardAll2AllBackend):
    """Uneven ``all_to_all_single`` dispatch / combine (see the module docstring)."""

    name = "all_to_all"
    # its count exchange stays when the counts are known, except for small padded dispatches
    blocks_under_dbo = True

    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        # The per-destination row counts depend on the routing, so the count exchange stays even
        # when the token counts are known; they are only checked (or size a padded dispatch).
        counts = self._check_num_tokens_across_ep(num_tokens_across_ep, hidden_states.shape[0])
        layout = self._row_layout(hidden_states, topk_ids, topk_weights)
        mask = token_rank_mask(
            topk_ids, num_local_experts=self.num_local_experts, ep_size=self.ep_size
        )
        # nonzero of the transposed mask lists (rank, token) pairs sorted by rank, then token.
        send_rank, send_token_idx = mask.t().nonzero(as_tuple=True)
        if counts is not None and (
            self.ep_size * (1 + max(counts)) * layout.row_bytes <= PADDED_DISPATCH_MAX_BYTES
        ):
            packed = self._pack_sent_rows(
                hidden_states, topk_ids, topk_weights, send_rank, send_token_idx, layout
            )
            return self._dispatch_padded(
                packed,
                mask,
                send_rank,
                send_token_idx,
                layout=layout,
                counts=counts,
                async_op=async_op,
            )
        send_counts, recv_counts, notify_ns = self._exchange_counts(mask, layout)
        packed = self._pack_sent_rows(
            hidden_states, topk_ids, topk_weights, send_rank, send_token_idx, layout
        )
        recv, pending, issued_at_ns = self._all_to_all_rows(packed, send_counts, recv_counts)
        metadata = self._metadata(
            layout, hidden_states.shape[0], send_counts, recv_counts, send_token_idx
        )
        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(len(send_token_idx) - send_counts[self.ep_rank]) * layout.row_bytes,
            num_recv_bytes=(recv.shape[0] - recv_counts[self.ep_rank]) * layout.row_bytes,
            notify_ns=notify_ns,
        )
        return self._handle(
            op="all_to_all dispatch",
            pending=pending,
            finalize=lambda: unpacked_result(recv, layout, metadata),
            timing=timing,
            async_op=async_op,
        )

    def _all_to_all_rows(
        self, send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> tuple[Tensor, Pending, int]:
        """Issue ONE uneven ``all_to_all_single`` of the rows of ``send`` (``[sum(send_counts),
        row_bytes]`` uint8, by destination rank); ``(recv [sum(recv_counts), row_bytes] uint8,
        pending, issued_at_ns)``."""
        recv = torch.empty(sum(recv_counts), send.shape[1], dtype=torch.uint8, device=send.device)
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv,
            send,
            output_split_sizes=list(recv_counts),
            input_split_sizes=list(send_counts),
            group=self.ep_group,
        )
        return recv, pending, issued_at_ns

    def _exchange_counts(
        self, mask: Tensor, layout
    ) -> tuple[list[int], list[int], tuple[int, int]]:
        """The count exchange: a small ``all_to_all_single`` of ``[ep_size, 4]`` int64 rows (rows
        for each peer, row format), checked for the row format; ``(send_counts, recv_counts,
        notify_ns)``. Blocking (DeepEP's notify: the payload splits must be known on the host).

        Raises:
            ValueError: (on every rank) the EP ranks disagree on the row format.
        """
        header = torch.tensor([[0, *layout.signature()]] * self.ep_size, dtype=torch.int64)
        header[:, 0] = mask.sum(dim=0).cpu()  # host sync: splits are host ints
        header = header.to(mask.device)
        recv_header = torch.empty_like(header)
        notify_start_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv_header,
            header,
            output_split_sizes=None,
            input_split_sizes=None,
            group=self.ep_group,
        )
        # blocking wait (timeout: self.timeout), DeepEP's notify step
        notify_ns = self._notify(
            pending,
            "all_to_all dispatch count exchange",
            issued_at_ns=notify_start_ns,
            num_bytes=header[0].numel() * 8,
        )
        recv_header = recv_header.cpu()
        self._check_signatures(recv_header[:, 1:].tolist(), layout, "all_to_all dispatch")
        return header[:, 0].tolist(), recv_header[:, 0].tolist(), notify_ns

    def _metadata(
        self, layout, num_tokens: int, send_counts, recv_counts, send_token_idx: Tensor
    ) -> AllToAllDispatchMetadata:
        return AllToAllDispatchMetadata(
            backend=self.name,
            ep_rank=self.ep_rank,
            num_tokens=num_tokens,
            num_recv_tokens=sum(recv_counts),
            hidden_size=layout.hidden_size,
            dtype=layout.dtype,
            send_counts=tuple(send_counts),
            recv_counts=tuple(recv_counts),
            send_token_idx=send_token_idx,
        )

    def _pack_sent_rows(
        self, hidden_states, topk_ids, topk_weights, send_rank, send_token_idx, layout
    ) -> Tensor:
        """The rows this rank sends, ``[len(send_token_idx), row_bytes]`` uint8: each sent token's
        hidden state with its top-k ids made local to the receiving rank (``localize_topk``)."""
        local_ids, local_weights = localize_topk(
            topk_ids[send_token_idx],
            topk_weights[send_token_idx].float(),
            send_rank,
            num_local_experts=self.num_local_experts,
        )
        return pack_rows(hidden_states[send_token_idx], local_ids, local_weights, layout)

    def _dispatch_padded(
        self,
        packed: Tensor,
        mask: Tensor,
        send_rank: Tensor,
        send_token_idx: Tensor,
        *,
        layout,
        counts: list[int],
        async_op: bool,
    ) -> CommHandle[DispatchResult]:
        """The dispatch without count exchange (module docstring): blocks of ``1 + counts[r]``
        rows from rank r, header row first. ``packed``: the sent rows (``_pack_sent_rows``)."""
        device, num_tokens = packed.device, mask.shape[0]
        block = 1 + num_tokens  # rows this rank sends each peer
        send_counts = mask.sum(dim=0)  # [ep_size] rows for each peer
        send = self._padded_send_buffer(packed, send_rank, send_counts, block, layout)
        recv_blocks = [1 + n for n in counts]
        recv, pending, issued_at_ns = self._all_to_all_rows(
            send, [block] * self.ep_size, recv_blocks
        )

        def finalize() -> DispatchResult:
            starts = [sum(recv_blocks[:r]) for r in range(self.ep_size)]  # loop over ranks
            headers = recv[starts, : 8 * _HEADER_INTS].contiguous().view(torch.int64).tolist()
            self._check_signatures([h[1:] for h in headers], layout, "all_to_all dispatch")
            recv_counts = [h[0] for h in headers]
            # host sync above (the counts); the valid rows of every block, in rank order
            valid = torch.cat(
                [
                    torch.arange(start + 1, start + 1 + n, device=device)
                    for start, n in zip(starts, recv_counts, strict=True)
                ]
            )
            metadata = self._metadata(
                layout, num_tokens, send_counts.tolist(), recv_counts, send_token_idx
            )
            return unpacked_result(recv[valid], layout, metadata)

        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(self.ep_size - 1) * block * layout.row_bytes,
            num_recv_bytes=(sum(recv_blocks) - recv_blocks[self.ep_rank]) * layout.row_bytes,
        )
        return self._handle(
            op="all_to_all dispatch",
            pending=pending,
            finalize=finalize,
            timing=timing,
            async_op=async_op,
        )

    def _padded_send_buffer(
        self, packed: Tensor, send_rank: Tensor, send_counts: Tensor, block: int, layout
    ) -> Tensor:
        """``[ep_size * block, row_bytes]`` uint8: per peer a header row (row count and row format,
        int64) and its packed rows, zero-padded to ``block`` rows."""
        device = packed.device
        header = torch.zeros(self.ep_size, _HEADER_INTS, dtype=torch.int64, device=device)
        header[:, 0] = send_counts
        header[:, 1:] = torch.tensor(layout.signature(), dtype=torch.int64, device=device)
        # row of each packed row in the send buffer: its peer's block, after the header row,
        # at its index among that peer's rows (pairs are sorted by peer)
        first_of_peer = torch.cumsum(send_counts, 0) - send_counts
        pair = torch.arange(send_rank.shape[0], device=device)
        rows = send_rank * block + 1 + pair - first_of_peer[send_rank]
        send = torch.zeros(self.ep_size * block, layout.row_bytes, dtype=torch.uint8, device=device)
        send.index_copy_(0, rows, packed)
        send.view(self.ep_size, block, -1)[:, 0, : 8 * _HEADER_INTS] = header.view(torch.uint8)
        return send

    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        self._check_combine(expert_output, metadata, AllToAllDispatchMetadata)
        assert isinstance(metadata, AllToAllDispatchMetadata)  # checked above; narrows the type
        dtype, hidden_size = metadata.dtype, metadata.hidden_size
        # Move raw bytes: all_to_all is a pure copy, so any dtype travels (gloo lacks some).
        send = expert_output.to(dtype).contiguous().view(torch.uint8)
        num_back = sum(metadata.send_counts)
        recv, pending, issued_at_ns = self._all_to_all_rows(
            send, metadata.recv_counts, metadata.send_counts
        )

        def finalize() -> Tensor:
            acc_dtype = torch.promote_types(dtype, torch.float32)  # float64 stays float64
            out = torch.zeros(metadata.num_tokens, hidden_size, dtype=acc_dtype, device=recv.device)
            rows = recv.view(dtype).to(acc_dtype)
            out.index_add_(0, metadata.send_token_idx.to(recv.device), rows)
            return out.to(dtype)

        row_bytes = send.shape[1]
        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(send.shape[0] - metadata.recv_counts[self.ep_rank]) * row_bytes,
            num_recv_bytes=(num_back - metadata.send_counts[self.ep_rank]) * row_bytes,
        )
        return self._handle(
            op="all_to_all combine",
            pending=pending,
            finalize=finalize,
            timing=timing,
            async_op=async_op,
        )
