"""``allgather_reducescatter``: simple and robust, only even-sized collectives. Dispatch all-gathers
every rank's packed rows (padded to the largest count) and keeps every row; combine
reduce-scatters the float32 (float64) expert outputs. Why every row is kept, and the count
exchange it skips: docs/backends.md#all-gather--reduce-scatter-every-row-kept."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from distributed.all2all.base import (
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    StandardDispatchMetadata,
    accumulation_dtype,
    complete_exchange,
)
from distributed.all2all.token_packing import RowLayout, localize_topk, pack_rows, unpack_rows
from distributed.collectives import all_gather_into, reduce_scatter_sum
from distributed.comm_handle import CommHandle, CommTiming


@dataclass(frozen=True, slots=True, kw_only=True)
class AllGatherDispatchMetadata(StandardDispatchMetadata):
    """Routing of one ``allgather_reducescatter`` dispatch."""

    max_tokens_across_ep: int  # rows per rank block in the gathered (padded) buffer


class AllGatherReduceScatterPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """All-gather dispatch / reduce-scatter combine (see the module docstring)."""

    name = "allgather_reducescatter"
    activation_format = FusedMoEActivationFormat.Standard

    def prepare(self, request: DispatchRequest) -> CommHandle[DispatchResult]:
        layout, counts = request.layout, request.num_tokens_across_ep
        device = request.hidden_states.device
        notify_ns = None
        if counts is None:
            counts, notify_ns = self._exchange_counts(request.num_tokens, layout, device)
        packed = pack_rows(
            request.hidden_states,
            request.topk_ids,
            request.topk_weights.float(),
            layout,
            num_rows=max(counts),
        )
        gathered = packed.new_empty(self.ep_size * packed.shape[0], layout.row_bytes)
        issued_at_ns = time.perf_counter_ns()
        pending = all_gather_into(gathered, packed, group=self.ep_group)
        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(self.ep_size - 1) * packed.numel(),
            notify_ns=notify_ns,
        )
        return self._handle(
            pending,
            lambda: self._kept_rows(gathered, request, counts),
            op="allgather dispatch",
            timing=timing,
        )

    def _kept_rows(self, gathered: Tensor, request: DispatchRequest, counts) -> DispatchResult:
        """The gathered ``[ep_size * max(counts), row_bytes]`` uint8 rows, ids made local: -1
        where the expert lives elsewhere and on padding rows (weights 0 there)."""
        max_tokens, device = max(counts), gathered.device
        ids, weights, hidden = unpack_rows(gathered, request.layout)
        local_ids, local_weights = localize_topk(
            ids, weights, self.ep_rank, num_local_experts=self.num_local_experts
        )
        num_real = torch.tensor(counts, device=device).unsqueeze(1)  # host-to-device, no read
        is_real = (torch.arange(max_tokens, device=device) < num_real).view(-1, 1)
        metadata = self._metadata(
            AllGatherDispatchMetadata,
            request,
            num_recv_tokens=gathered.shape[0],
            max_tokens_across_ep=max_tokens,
        )
        return DispatchResult(
            hidden_states=hidden.contiguous(),
            topk_ids=torch.where(is_real, local_ids, -1),
            topk_weights=torch.where(is_real, local_weights, 0.0),
            metadata=metadata,
        )

    def _exchange_counts(
        self, num_tokens: int, layout: RowLayout, device
    ) -> tuple[list[int], tuple[int, int]]:
        """All-gather every rank's token count (and row format, checked equal); blocking."""
        header = torch.tensor([num_tokens, *layout.signature()], dtype=torch.int64, device=device)
        headers = torch.empty(self.ep_size, header.numel(), dtype=torch.int64, device=device)
        start_ns = time.perf_counter_ns()
        pending = all_gather_into(headers, header.unsqueeze(0), group=self.ep_group)
        notify_ns = complete_exchange(  # blocking wait: the padded size must be on the host
            pending,
            op="allgather dispatch count exchange",
            rank=self.ep_rank,
            timeout=self.timeout,
            num_bytes=(self.ep_size - 1) * header.numel() * 8,
            start_ns=start_ns,
            link=self.link,
        )
        headers = headers.cpu()
        layout.check_signatures(headers[:, 1:].tolist(), "allgather dispatch", self.ep_rank)
        return headers[:, 0].tolist(), notify_ns

    def finalize(
        self, expert_output: Tensor, metadata: AllGatherDispatchMetadata
    ) -> CommHandle[Tensor]:
        max_tokens, hidden_size = metadata.max_tokens_across_ep, metadata.hidden_size
        device = expert_output.device
        # the reduction over ranks accumulates in this buffer (gloo reduces fp32, fp64, not bf16)
        acc_dtype = accumulation_dtype(metadata.dtype)
        padded = expert_output.to(acc_dtype).contiguous()  # every gathered row, in rank blocks
        out = torch.empty(max_tokens, hidden_size, dtype=acc_dtype, device=device)
        issued_at_ns = time.perf_counter_ns()
        pending = reduce_scatter_sum(out, padded, group=self.ep_group)
        timing = CommTiming(
            issued_at_ns=issued_at_ns,
            num_bytes=(self.ep_size - 1) * max_tokens * hidden_size * acc_dtype.itemsize,
        )
        return self._handle(
            pending,
            lambda: out[: metadata.num_tokens].to(metadata.dtype),
            op="reducescatter combine",
            timing=timing,
        )
