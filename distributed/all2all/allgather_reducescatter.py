"""``allgather_reducescatter``: simple and robust, only even-sized collectives.

Dispatch: all-gather the token counts (blocking, small; skipped when the DP ranks agreed on
them, as under DBO), then every rank's packed rows padded to the largest count in ONE all-gather;
a rank keeps the rows with an expert of its own (ids made local). Combine: the expert outputs
scattered into a zeroed ``[ep_size * max_tokens, hidden_size]`` float32 (float64) buffer,
reduce-scattered (summed over ranks), this rank's ``num_tokens`` rows kept.
"""

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
    # [num_recv_tokens] int64, each kept row's place in the gathered [ep_size * max_tokens] rows
    kept_row_idx: Tensor


class AllGatherReduceScatterBackend(FusedMoEPrepareAndFinalize):
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
        """The gathered ``[ep_size * max(counts), row_bytes]`` uint8 rows with an expert on this
        rank (padding rows dropped), ids made local."""
        max_tokens = max(counts)
        ids, weights, hidden = unpack_rows(gathered, request.layout)
        local_ids, local_weights = localize_topk(
            ids, weights, self.ep_rank, num_local_experts=self.num_local_experts
        )
        is_real = torch.cat(
            [torch.arange(max_tokens, device=gathered.device) < count for count in counts]
        )
        kept = ((local_ids >= 0).any(dim=1) & is_real).nonzero().squeeze(1)
        metadata = self._metadata(
            AllGatherDispatchMetadata,
            request,
            num_recv_tokens=kept.numel(),
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
        padded = torch.zeros(self.ep_size * max_tokens, hidden_size, dtype=acc_dtype, device=device)
        padded.index_copy_(0, metadata.kept_row_idx.to(device), expert_output.to(acc_dtype))
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
