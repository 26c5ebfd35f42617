"""``deepep_high_throughput``: dispatch / combine as calls of DeepEP's high-throughput ``Buffer``
API (``get_dispatch_layout``, ``dispatch``, ``combine`` with ``async_finish`` and
``previous_event``), as vLLM's ``DeepEPHTPrepareAndFinalize`` makes them, on DeepEP's kernels or
our emulation. The dispatch's notify waits for the receive sizes on the host, so it blocks inside
DBO's window as ``all_to_all`` does; rows arrive with LOCAL top-k ids and weights (``Standard``)
and combine sums a token's rows over the ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import Tensor

from distributed.all2all.base import (
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    StandardDispatchMetadata,
)
from distributed.all2all.deepep_buffer import DeepEPPrepareAndFinalizeBase
from distributed.comm_handle import CommHandle


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepEPHTDispatchMetadata(StandardDispatchMetadata):
    handle: object  # DeepEP's handle (opaque; its combine takes it back)


class DeepEPHTPrepareAndFinalize(DeepEPPrepareAndFinalizeBase):
    """DeepEP high-throughput dispatch / combine (see the module docstring)."""

    name = "deepep_high_throughput"
    activation_format = FusedMoEActivationFormat.Standard
    blocks_under_dbo = True  # the notify step needs routing-dependent counts on the host
    low_latency_mode = False

    def prepare(self, request: DispatchRequest) -> CommHandle[DispatchResult]:
        buffer = self.buffer
        per_rank, per_rdma_rank, per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
            request.topk_ids, self.num_experts, self.previous_event()
        )
        start_ns = time.perf_counter_ns()
        previous_event = self.previous_event()
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = buffer.dispatch(
            request.hidden_states,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=request.topk_ids,
            topk_weights=request.topk_weights.float(),
            previous_event=previous_event,
            async_finish=True,
            allocate_on_comm_stream=previous_event is not None,
        )
        metadata = self._metadata(
            DeepEPHTDispatchMetadata, request, num_recv_tokens=recv_x.shape[0], handle=handle
        )

        def finalize() -> DispatchResult:
            return DispatchResult(
                hidden_states=recv_x.contiguous(),
                topk_ids=recv_topk_idx.contiguous(),
                topk_weights=recv_topk_weights.contiguous(),
                metadata=metadata,
            )

        return self._buffer_handle("deepep_high_throughput dispatch", event, finalize, start_ns)

    def finalize(
        self, expert_output: Tensor, metadata: DeepEPHTDispatchMetadata
    ) -> CommHandle[Tensor]:
        start_ns = time.perf_counter_ns()
        previous_event = self.previous_event()
        combined_x, _, event = self.buffer.combine(
            expert_output.to(metadata.dtype),
            metadata.handle,
            previous_event=previous_event,
            async_finish=True,
            allocate_on_comm_stream=previous_event is not None,
        )
        return self._buffer_handle(
            "deepep_high_throughput combine", event, lambda: combined_x, start_ns
        )
