"""``deepep_low_latency`` backend: our dispatch / combine as calls of DeepEP's low-latency
``Buffer`` API (``low_latency_dispatch`` / ``low_latency_combine`` with
``num_max_dispatch_tokens_per_rank`` and ``return_recv_hook=True``), on DeepEP's kernels or on
our torch.distributed emulation (``deepep_low_latency_protocol``). vLLM's
``DeepEPLLPrepareAndFinalize`` makes the same calls.

No count exchange: every rank owns a fixed slot of C rows per (rank, expert) in its peers'
buffers, so a dispatch issues at once and never blocks; the returned handle's ``wait()`` runs
DeepEP's receive hook, which is what the modular kernel hands to the other ubatch with
``dbo_register_recv_hook``. Received tokens come grouped per local expert
(``BatchedDispatchResult``: ``[num_local_experts, ep_size * C, hidden]`` + per-expert counts), the
experts compute on that layout and combine applies the top-k weights.

Capacity C: the buffer is sized for ``num_max_dispatch_tokens_per_rank`` (the engine derives it
from ``--max-num-batched-tokens``: no step, microbatched or not, has more rows per rank). A call
whose token counts on every rank are known (``num_tokens_across_ep``: the DP ranks agreed on them,
e.g. the ubatch size under DBO) uses their max as its C, the same on every rank without a message;
otherwise the full capacity. More tokens than the capacity raise ``ValueError`` naming both.

Ubatches: our emulation allocates each call's buffers, so any number of ubatches may have calls in
flight; DeepEP's kernels double-buffer (a call's results live in one of two buffer halves until
the next-but-one call), so with them ``max_num_ubatches`` is 2 and the engine refuses more.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.base import (
    BatchedAll2AllBackend,
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DispatchMetadata,
)
from distributed.all2all.deepep_common import DeepEPBufferMixin
from distributed.all2all.deepep_kernels import DEEPEP_KERNELS, completion_work
from distributed.comm_handle import CommHandle

# DeepEP's own tests size the low-latency buffer for 128 tokens per rank
DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepEPLLDispatchMetadata(BatchedDispatchMetadata):
    """Routing of one LL dispatch (``max_tokens_per_expert`` = ``ep_size * C``: a slot of C rows
    per source rank).

    Attributes:
        handle: DeepEP's handle (opaque; combine takes it back).
        num_max_dispatch_tokens_per_rank: the call's capacity C.
        topk_ids: ``[num_tokens, num_topk]`` int64 GLOBAL ids as dispatched.
        topk_weights: ``[num_tokens, num_topk]`` float32, applied by combine.
    """

    handle: object
    num_max_dispatch_tokens_per_rank: int
    topk_ids: Tensor
    topk_weights: Tensor


class DeepEPLowLatencyBackend(DeepEPBufferMixin, BatchedAll2AllBackend):
    """DeepEP low-latency dispatch / combine (see the module docstring).

    Extra args (besides ``All2AllBackend``'s; ``extra_options``): ``hidden_size`` and
    ``num_max_dispatch_tokens_per_rank`` (the capacity C per rank) size DeepEP's buffer;
    ``buffer``: a ready Buffer-shaped object (tests), else ``make_deepep_buffer``.

    Raises:
        ValueError: ``num_max_dispatch_tokens_per_rank < 1`` (and ``All2AllBackend``'s checks).
    """

    name = "deepep_low_latency"
    blocks_under_dbo = False  # no count exchange: fixed slots per (rank, expert)

    def __init__(
        self,
        *,
        ep_group: ProcessGroup | None,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        timeout: datetime.timedelta,
        hidden_size: int = 0,
        num_max_dispatch_tokens_per_rank: int = DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK,
        buffer=None,
    ) -> None:
        if num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank must be >= 1, got "
                f"{num_max_dispatch_tokens_per_rank}"
            )
        super().__init__(
            ep_group=ep_group,
            ep_rank=ep_rank,
            ep_size=ep_size,
            num_experts=num_experts,
            timeout=timeout,
        )
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self._attach_buffer(
            buffer,
            low_latency_mode=True,
            hidden_size=hidden_size,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        )
        if self.implementation == DEEPEP_KERNELS:
            # DeepEP's LL buffer has two halves: a third call overwrites the first's results
            # ("do not hold more than 2 low-latency kernels' result tensors at a time")
            self.max_num_ubatches = 2

    def dispatch_capacity(self, num_tokens: int, counts: list[int] | None) -> int:
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

    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[BatchedDispatchResult]:
        num_tokens = hidden_states.shape[0]
        counts = self._check_num_tokens_across_ep(num_tokens_across_ep, num_tokens)
        layout = self._row_layout(hidden_states, topk_ids, topk_weights)
        capacity = self.dispatch_capacity(num_tokens, counts)
        start_ns = time.perf_counter_ns()
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            hidden_states,
            topk_ids,
            capacity,
            self.num_experts,
            use_fp8=False,
            async_finish=False,
            return_recv_hook=True,
        )
        metadata = DeepEPLLDispatchMetadata(
            backend=self.name,
            ep_rank=self.ep_rank,
            num_tokens=num_tokens,
            max_tokens_per_expert=self.ep_size * capacity,
            hidden_size=layout.hidden_size,
            dtype=layout.dtype,
            handle=handle,
            num_max_dispatch_tokens_per_rank=capacity,
            topk_ids=topk_ids,
            topk_weights=topk_weights.float(),
        )

        def finalize() -> BatchedDispatchResult:
            return BatchedDispatchResult(
                hidden_states=recv_x, expert_num_tokens=recv_count, metadata=metadata
            )

        return self._deepep_handle(
            "deepep_low_latency dispatch", completion_work(hook), finalize, start_ns, async_op
        )

    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        """``BatchedAll2AllBackend.combine``: ``expert_output`` ``[num_local_experts, ep_size * C,
        hidden_size]`` UNWEIGHTED; DeepEP's combine applies ``metadata.topk_weights``."""
        self._check_combine(expert_output, metadata, DeepEPLLDispatchMetadata)
        assert isinstance(metadata, DeepEPLLDispatchMetadata)  # checked above; narrows the type
        start_ns = time.perf_counter_ns()
        combined_x, _, hook = self.buffer.low_latency_combine(
            expert_output.to(metadata.dtype),
            metadata.topk_ids,
            metadata.topk_weights,
            metadata.handle,
            return_recv_hook=True,
        )
        return self._deepep_handle(
            "deepep_low_latency combine",
            completion_work(hook),
            lambda: combined_x,
            start_ns,
            async_op,
        )
