"""``deepep_high_throughput`` backend: our dispatch / combine as calls of DeepEP's high-throughput
``Buffer`` API (``get_dispatch_layout``, ``dispatch`` and ``combine`` with ``async_finish`` and
``previous_event``), on DeepEP's kernels or on our torch.distributed emulation of the protocol
(``deepep_buffer``). vLLM's ``DeepEPHTPrepareAndFinalize`` makes the same calls.

Dispatch = layout + notify (a blocking count exchange: DeepEP's CPU waits for the receive sizes,
so this backend blocks inside DBO's overlapped window, as ``all_to_all`` does) + payload in flight.
The rows come back with LOCAL top-k ids and weights (standard activation format); the experts
apply the weights and combine sums a token's rows over ranks.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.base import (
    DispatchMetadata,
    DispatchResult,
    StandardAll2AllBackend,
    StandardDispatchMetadata,
)
from distributed.all2all.deepep_common import DeepEPBufferMixin, previous_event
from distributed.all2all.deepep_kernels import completion_work
from distributed.comm_handle import CommHandle


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepEPHTDispatchMetadata(StandardDispatchMetadata):
    """Routing of one HT dispatch: DeepEP's ``handle`` (opaque; combine takes it back)."""

    handle: object


class DeepEPHighThroughputBackend(DeepEPBufferMixin, StandardAll2AllBackend):
    """DeepEP high-throughput dispatch / combine (see the module docstring).

    Extra args (besides ``All2AllBackend``'s; ``extra_options``): ``hidden_size`` and
    ``num_max_dispatch_tokens_per_rank`` size DeepEP's buffer (unused by the emulation);
    ``buffer``: a ready Buffer-shaped object (tests), else ``make_deepep_buffer``.
    """

    name = "deepep_high_throughput"
    blocks_under_dbo = True  # the notify step needs routing-dependent counts on the host

    def __init__(
        self,
        *,
        ep_group: ProcessGroup | None,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        timeout: datetime.timedelta,
        hidden_size: int = 0,
        num_max_dispatch_tokens_per_rank: int = 0,
        buffer=None,
    ) -> None:
        super().__init__(
            ep_group=ep_group,
            ep_rank=ep_rank,
            ep_size=ep_size,
            num_experts=num_experts,
            timeout=timeout,
        )
        self._attach_buffer(
            buffer,
            low_latency_mode=False,
            hidden_size=hidden_size,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        )

    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        self._check_num_tokens_across_ep(num_tokens_across_ep, hidden_states.shape[0])
        layout = self._row_layout(hidden_states, topk_ids, topk_weights)
        buffer = self.buffer
        (
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            _,
        ) = buffer.get_dispatch_layout(topk_ids, self.num_experts, previous_event(buffer))
        start_ns = time.perf_counter_ns()
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = buffer.dispatch(
            hidden_states,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_ids,
            topk_weights=topk_weights.float(),
            previous_event=previous_event(buffer),
            async_finish=True,
            allocate_on_comm_stream=previous_event(buffer) is not None,
        )
        work = completion_work(event)
        metadata = DeepEPHTDispatchMetadata(
            backend=self.name,
            ep_rank=self.ep_rank,
            num_tokens=hidden_states.shape[0],
            num_recv_tokens=recv_x.shape[0],
            hidden_size=layout.hidden_size,
            dtype=layout.dtype,
            handle=handle,
        )

        def finalize() -> DispatchResult:
            return DispatchResult(
                hidden_states=recv_x.contiguous(),
                topk_ids=recv_topk_idx.contiguous(),
                topk_weights=recv_topk_weights.contiguous(),
                metadata=metadata,
            )

        return self._deepep_handle(
            "deepep_high_throughput dispatch", work, finalize, start_ns, async_op
        )

    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        self._check_combine(expert_output, metadata, DeepEPHTDispatchMetadata)
        assert isinstance(metadata, DeepEPHTDispatchMetadata)  # checked above; narrows the type
        start_ns = time.perf_counter_ns()
        combined_x, _, event = self.buffer.combine(
            expert_output.to(metadata.dtype),
            metadata.handle,
            previous_event=previous_event(self.buffer),
            async_finish=True,
            allocate_on_comm_stream=previous_event(self.buffer) is not None,
        )
        return self._deepep_handle(
            "deepep_high_throughput combine",
            completion_work(event),
            lambda: combined_x,
            start_ns,
            async_op,
        )
