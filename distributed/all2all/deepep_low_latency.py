"""``deepep_low_latency``: dispatch / combine as calls of DeepEP's low-latency ``Buffer`` API
(``low_latency_dispatch`` / ``low_latency_combine``, ``return_recv_hook=True``), as vLLM's
``DeepEPLLPrepareAndFinalize`` makes them, on DeepEP's kernels or our emulation: fixed slots, no
count exchange, tokens grouped per local expert (``BatchedExperts``). Slots, capacity and the
ubatch limit: docs/backends.md#low-latency-details."""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import Tensor

from distributed.all2all.base import (
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DispatchRequest,
    FusedMoEActivationFormat,
)
from distributed.all2all.deepep_buffer import DeepEPPrepareAndFinalizeBase
from distributed.comm_handle import CommHandle


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepEPLLDispatchMetadata(BatchedDispatchMetadata):
    """Routing of one LL dispatch (``max_tokens_per_expert`` = ``ep_size * C``)."""

    handle: object  # DeepEP's (opaque; its combine takes it back)
    num_max_dispatch_tokens_per_rank: int  # the call's capacity C
    topk_ids: Tensor  # [num_tokens, num_topk] int64 GLOBAL ids, as dispatched
    topk_weights: Tensor  # [num_tokens, num_topk] float32, applied by combine


class DeepEPLLPrepareAndFinalize(DeepEPPrepareAndFinalizeBase):
    """DeepEP low-latency dispatch / combine (see the module docstring)."""

    name = "deepep_low_latency"
    activation_format = FusedMoEActivationFormat.BatchedExperts
    low_latency_mode = True
    # "do not hold more than 2 low-latency kernels' result tensors at a time" (DeepEP)
    kernels_max_num_ubatches = 2

    def dispatch_capacity(self, num_tokens: int, counts: tuple[int, ...] | None) -> int:
        """The call's C: the agreed max row count (>= 1) when known, else the full capacity.

        Raises:
            ValueError: if ``num_tokens`` (or an agreed count) exceeds the capacity.
        """
        largest = num_tokens if counts is None else max(counts)
        if largest > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"deepep_low_latency: a dispatch of {largest} tokens per rank exceeds "
                f"num_max_dispatch_tokens_per_rank={self.num_max_dispatch_tokens_per_rank} "
                f"(the buffer's capacity, derived from --max-num-batched-tokens)"
            )
        return self.num_max_dispatch_tokens_per_rank if counts is None else max(1, largest)

    def prepare(self, request: DispatchRequest) -> CommHandle[BatchedDispatchResult]:
        capacity = self.dispatch_capacity(request.num_tokens, request.num_tokens_across_ep)
        start_ns = time.perf_counter_ns()
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            request.hidden_states,
            request.topk_ids,
            capacity,
            self.num_experts,
            use_fp8=False,
            async_finish=False,
            return_recv_hook=True,
        )
        metadata = self._metadata(
            DeepEPLLDispatchMetadata,
            request,
            max_tokens_per_expert=self.ep_size * capacity,
            handle=handle,
            num_max_dispatch_tokens_per_rank=capacity,
            topk_ids=request.topk_ids,
            topk_weights=request.topk_weights.float(),
        )

        def finalize() -> BatchedDispatchResult:
            return BatchedDispatchResult(
                hidden_states=recv_x, expert_num_tokens=recv_count, metadata=metadata
            )

        return self._buffer_handle("deepep_low_latency dispatch", hook, finalize, start_ns)

    def finalize(
        self, expert_output: Tensor, metadata: DeepEPLLDispatchMetadata
    ) -> CommHandle[Tensor]:
        start_ns = time.perf_counter_ns()
        combined_x, _, hook = self.buffer.low_latency_combine(
            expert_output.to(metadata.dtype),
            metadata.topk_ids,
            metadata.topk_weights,
            metadata.handle,
            return_recv_hook=True,
        )
        return self._buffer_handle("deepep_low_latency combine", hook, lambda: combined_x, start_ns)
