"""``allgather_reducescatter`` backend: simple and robust (only even-sized collectives).

Dispatch: all-gather every rank's token count (blocking, small; skipped when the caller passes
``num_tokens_across_ep``, as under DBO), pad each rank's packed rows to the max count across EP,
all-gather the padded ``[ep_size * max_tokens, row_bytes]`` uint8 buffer in ONE collective, and
keep the rows with at least one expert on this rank (DeepEP high-throughput semantics: a token
reaches each rank holding one of its experts once, ids made local).
Combine: scatter the expert outputs into a zeroed float32 ``[ep_size * max_tokens, hidden_size]``
buffer and reduce-scatter it (sum over ranks in float32), keeping this rank's ``num_tokens`` rows.
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
from distributed.all2all.token_packing import localize_topk, pack_rows, unpack_rows
from distributed.collectives import all_gather_into, reduce_scatter_sum
from distributed.comm_handle import CommHandle, CommTiming


@dataclass(frozen=True, slots=True, kw_only=True)
class AllGatherDispatchMetadata(StandardDispatchMetadata):
    """Routing of one ``allgather_reducescatter`` dispatch.

    Attributes:
        max_tokens_across_ep: rows per rank block in the gathered (padded) buffer.
        kept_row_idx: ``[num_recv_tokens]`` torch.int64, the position of each received row in the
            gathered ``[ep_size * max_tokens_across_ep]`` buffer (block = source rank).
    """

    max_tokens_across_ep: int
    kept_row_idx: Tensor


class AllGatherReduceScatterBackend(StandardAll2AllBackend):
    """All-gather dispatch / reduce-scatter combine (see the module docstring)."""

    name = "allgather_reducescatter"

    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        layout = self._row_layout(hidden_states, topk_ids, topk_weights)
        device = hidden_states.device
        num_tokens = hidden_states.shape[0]
        counts = self._check_num_tokens_across_ep(num_tokens_across_ep, num_tokens)
        notify_ns = None
        if counts is None:
            counts, notify_ns = self._exchange_counts(num_tokens, layout, device)
        max_tokens = max(counts)

        packed = pack_rows(
            hidden_states, topk_ids, topk_weights.float(), layout, num_rows=max_tokens
        )
        gathered = torch.empty(
            self.ep_size * max_tokens, layout.row_bytes, dtype=torch.uint8, device=device
        )
        issued_at_ns = time.perf_counter_ns()
        pending = all_gather_into(gathered, packed, group=self.ep_group)
        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(self.ep_size - 1) * packed.numel(),
            notify_ns=notify_ns,
        )
        return self._handle(
            op="allgather dispatch",
            pending=pending,
            finalize=lambda: self._kept_rows(gathered, layout, counts, num_tokens),
            timing=timing,
            async_op=async_op,
        )

    def _kept_rows(
        self, gathered: Tensor, layout, counts: list[int], num_tokens: int
    ) -> DispatchResult:
        """The gathered ``[ep_size * max(counts), row_bytes]`` uint8 rows that have at least one
        expert on this rank (padding rows dropped), ids made local."""
        max_tokens = max(counts)
        ids, weights, hidden = unpack_rows(gathered, layout)
        local_ids, local_weights = localize_topk(
            ids, weights, self.ep_rank, num_local_experts=self.num_local_experts
        )
        is_real = torch.cat(
            [torch.arange(max_tokens, device=gathered.device) < count for count in counts]
        )
        kept = ((local_ids >= 0).any(dim=1) & is_real).nonzero().squeeze(1)
        metadata = AllGatherDispatchMetadata(
            backend=self.name,
            ep_rank=self.ep_rank,
            num_tokens=num_tokens,
            num_recv_tokens=kept.numel(),
            hidden_size=layout.hidden_size,
            dtype=layout.dtype,
            max_tokens_across_ep=max_tokens,
            kept_row_idx=kept,
        )
        return DispatchResult(
            hidden_states=hidden[kept],
            topk_ids=local_ids[kept],
            topk_weights=local_weights[kept],
            metadata=metadata,
        )

    def _exchange_counts(
        self, num_tokens: int, layout, device
    ) -> tuple[list[int], tuple[int, int]]:
        """All-gather every rank's token count (and row format, checked equal); blocking."""
        header = torch.tensor([num_tokens, *layout.signature()], dtype=torch.int64, device=device)
        headers = torch.empty(self.ep_size, header.numel(), dtype=torch.int64, device=device)
        notify_start_ns = time.perf_counter_ns()
        pending = all_gather_into(headers, header.unsqueeze(0), group=self.ep_group)
        # blocking wait (timeout: self.timeout): the padded size must be known on the host
        notify_ns = self._notify(
            pending,
            "allgather dispatch count exchange",
            issued_at_ns=notify_start_ns,
            num_bytes=(self.ep_size - 1) * header.numel() * 8,
        )
        headers = headers.cpu()
        self._check_signatures(headers[:, 1:].tolist(), layout, "allgather dispatch")
        return headers[:, 0].tolist(), notify_ns

    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        self._check_combine(expert_output, metadata, AllGatherDispatchMetadata)
        assert isinstance(metadata, AllGatherDispatchMetadata)  # checked above; narrows the type
        max_tokens, hidden_size = metadata.max_tokens_across_ep, metadata.hidden_size
        device = expert_output.device
        # float32 buffer (float64 for float64): the reduction over ranks accumulates in it (and
        # gloo reduces fp32 and fp64, not bf16).
        acc_dtype = torch.promote_types(metadata.dtype, torch.float32)
        padded = torch.zeros(self.ep_size * max_tokens, hidden_size, dtype=acc_dtype, device=device)
        padded.index_copy_(0, metadata.kept_row_idx.to(device), expert_output.to(acc_dtype))
        out = torch.empty(max_tokens, hidden_size, dtype=acc_dtype, device=device)
        issued_at_ns = time.perf_counter_ns()
        pending = reduce_scatter_sum(out, padded, group=self.ep_group)

        def finalize() -> Tensor:
            return out[: metadata.num_tokens].to(metadata.dtype)

        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(self.ep_size - 1) * max_tokens * hidden_size * acc_dtype.itemsize,
        )
        return self._handle(
            op="reducescatter combine",
            pending=pending,
            finalize=finalize,
            timing=timing,
            async_op=async_op,
        )
