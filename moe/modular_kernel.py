"""Modular fused-MoE kernel: one MoE layer's token flow, with DBO yield points.

    [Router] → [Prepare/Dispatch] → [Experts] → [Finalize/Combine]

The router runs in ``FusedMoE``; this module owns the other three stages. Prepare and finalize live
in ONE class (``FusedMoEPrepareAndFinalize``) because they are two halves of one communication
pattern: finalize must undo exactly what prepare did (send tokens out, bring results back in the
caller's order), using the metadata prepare returned — nothing is stashed on ``self`` in between.
(Layout after vLLM's ``FusedMoEModularKernel``.)

DBO protocol (vLLM ``FusedMoEModularKernel.forward`` + the seed schedule): when a ubatch context is
current, prepare/finalize are issued asynchronously, their ``wait`` is handed to the OTHER ubatch as
a receive hook, and this ubatch yields; whoever runs the hook first completes the transfer, and the
second ``wait()`` is an idempotent no-op.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor

from dbo.timeline import CAT_COMM, CAT_COMPUTE, CAT_WAIT, record_span, timeline_span
from dbo.ubatch_context import (
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_num_tokens_across_dp,
    dbo_register_recv_hook,
    dbo_yield,
)
from distributed import CommHandle, DispatchMetadata, DispatchResult

if TYPE_CHECKING:
    from distributed import All2AllBackend
    from moe.experts import TorchExperts

T = TypeVar("T")


class CompletedHandle(Generic[T]):
    """A ``CommHandle``-shaped handle whose value is ready at construction (no communication).

    Same surface as ``distributed.CommHandle``: ``wait()`` (idempotent), ``is_completed()``,
    ``issued_at_ns``, ``completed_at_ns``, ``num_bytes`` (0: nothing was sent).
    """

    __slots__ = ("_value", "issued_at_ns", "completed_at_ns", "num_bytes")

    def __init__(self, value: T):
        self._value = value
        self.issued_at_ns = time.perf_counter_ns()
        self.completed_at_ns: int | None = self.issued_at_ns
        self.num_bytes = 0

    def wait(self) -> T:
        return self._value

    def is_completed(self) -> bool:
        return True


class FusedMoEPrepareAndFinalize(ABC):
    """Moves tokens to the ranks that own their experts (prepare) and results back (finalize)."""

    @property
    @abstractmethod
    def num_local_experts(self) -> int:
        """Experts held by this rank; prepared topk_ids are local ids in [0, num_local_experts)."""

    @abstractmethod
    def prepare(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        """Dispatch tokens to their experts' ranks.

        Args:
            hidden_states: [num_tokens, hidden_size] (num_tokens may be 0).
            topk_ids: [num_tokens, num_topk] int64 GLOBAL expert ids.
            topk_weights: [num_tokens, num_topk] float32.
            async_op: leave the payload in flight; ``wait()`` completes it.
            num_tokens_across_ep: every EP rank's num_tokens, when already agreed (under DBO); a
                backend may then skip its blocking count exchange.

        Returns:
            A handle whose ``wait()`` gives the rows this rank must compute, with LOCAL expert ids
            (-1 = slot not on this rank) and the metadata ``finalize`` needs.
        """

    @abstractmethod
    def finalize(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool
    ) -> CommHandle[Tensor]:
        """Send per-row expert results back; ``wait()`` gives [num_tokens, hidden_size] in the
        caller's original token order (the weighted sum over all top-k experts)."""


class NoEPPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """ep_size == 1: this rank holds every expert, so prepare and finalize move nothing.

    Global ids equal local ids; handles come back already completed.
    """

    def __init__(self, *, num_experts: int):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self._num_experts = num_experts

    @property
    def num_local_experts(self) -> int:
        return self._num_experts

    def prepare(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        num_tokens, hidden_size = hidden_states.shape
        result = DispatchResult(
            hidden_states=hidden_states,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            metadata=DispatchMetadata(
                backend="no_ep",
                ep_rank=0,
                num_tokens=num_tokens,
                num_recv_tokens=num_tokens,
                hidden_size=hidden_size,
                dtype=hidden_states.dtype,
            ),
        )
        return CompletedHandle(result)  # type: ignore[return-value]

    def finalize(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool
    ) -> CommHandle[Tensor]:
        return CompletedHandle(expert_output)  # type: ignore[return-value]


class All2AllPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """Expert parallelism through a ``distributed.All2AllBackend`` (dispatch / combine)."""

    def __init__(self, backend: All2AllBackend):
        self.backend = backend

    @property
    def num_local_experts(self) -> int:
        return self.backend.num_local_experts

    def prepare(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        return self.backend.dispatch(
            hidden_states,
            topk_ids,
            topk_weights,
            async_op=async_op,
            num_tokens_across_ep=num_tokens_across_ep,
        )

    def finalize(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool
    ) -> CommHandle[Tensor]:
        return self.backend.combine(expert_output, metadata, async_op=async_op)


def _recv_hook(handle: CommHandle, op: str) -> Callable[[], None]:
    """``handle.wait`` as a recv hook that completes under the grad mode the transfer was issued in.

    The other ubatch may run the hook at its ``__exit__``, i.e. outside the ``torch.inference_mode``
    a caller wrapped the model in; finalizing (in-place ops on buffers made at issue time) outside
    it would raise "Inplace update to inference tensor outside InferenceMode". The time the running
    ubatch blocks in it is recorded as a ``wait`` span.
    """
    is_inference = torch.is_inference_mode_enabled()

    def hook() -> None:
        with torch.inference_mode(is_inference), timeline_span(f"wait_{op}", CAT_WAIT):
            handle.wait()

    return hook


def _wait(handle: CommHandle[T], op: str) -> T:
    """``handle.wait()``, recorded as a ``wait`` span unless the data had already arrived (e.g. a
    recv hook completed it)."""
    if handle.is_completed():
        return handle.wait()  # does not block: at most runs the finalize step
    with timeline_span(f"wait_{op}", CAT_WAIT):
        return handle.wait()  # blocking wait (group timeout) inside CommHandle.wait


def _record_issue(op: str, start_ns: int, handle: CommHandle) -> None:
    """Spans of one issue: the CPU work before the payload leaves (``{op}_prep``, compute), the
    blocking count exchange if the backend made one (``{op}_notify``, comm)."""
    notify = getattr(handle, "notify_ns", None)
    issued_at_ns = max(handle.issued_at_ns, start_ns)
    if notify is None:
        record_span(
            f"{op}_prep", cat=CAT_COMPUTE, start_ns=start_ns, end_ns=issued_at_ns, kind="compute"
        )
        return
    notify_start, notify_end = notify
    record_span(
        f"{op}_prep", cat=CAT_COMPUTE, start_ns=start_ns, end_ns=notify_start, kind="compute"
    )
    record_span(f"{op}_notify", cat=CAT_COMM, start_ns=notify_start, end_ns=notify_end, kind="comm")
    record_span(
        f"{op}_prep", cat=CAT_COMPUTE, start_ns=notify_end, end_ns=issued_at_ns, kind="compute"
    )


def _record_comm(op: str, handle: CommHandle) -> None:
    end_ns = handle.completed_at_ns or time.perf_counter_ns()
    record_span(
        op, cat=CAT_COMM, start_ns=handle.issued_at_ns, end_ns=end_ns, kind="comm",
        args={"num_bytes": handle.num_bytes},
    )  # fmt: skip


class FusedMoEModularKernel:
    """Prepare → experts → finalize for routed tokens, with the DBO yield/recv-hook protocol."""

    def __init__(self, prepare_finalize: FusedMoEPrepareAndFinalize, experts: TorchExperts):
        if prepare_finalize.num_local_experts != experts.num_local_experts:
            raise ValueError(
                f"prepare_finalize serves {prepare_finalize.num_local_experts} local experts but "
                f"experts holds {experts.num_local_experts}"
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    def forward(
        self,
        hidden_states: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        *,
        shared_experts: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Routed-expert output (plus shared experts, when given) of every token.

        Args:
            hidden_states: [num_tokens, hidden_size]
            topk_weights: [num_tokens, num_topk] float32
            topk_ids: [num_tokens, num_topk] int64 GLOBAL expert ids
            shared_experts: optional dense MLP run on hidden_states while the combine is in flight.

        Returns:
            [num_tokens, hidden_size] in hidden_states' dtype.
        """
        is_async = dbo_enabled()
        # Complete the other ubatch's in-flight transfer before issuing ours (vLLM order).
        dbo_maybe_run_recv_hook()
        issue_ns = time.perf_counter_ns()
        dispatch = self.prepare_finalize.prepare(
            hidden_states,
            topk_ids,
            topk_weights,
            async_op=is_async,
            # under DBO the DP ranks agreed on every ubatch's size: no count exchange needed
            num_tokens_across_ep=dbo_num_tokens_across_dp(),
        )
        _record_issue("dispatch", issue_ns, dispatch)
        if is_async:
            dbo_register_recv_hook(_recv_hook(dispatch, "dispatch"))
            dbo_yield()
        result = _wait(dispatch, "dispatch")
        _record_comm("dispatch", dispatch)

        with timeline_span("experts"):
            expert_output = self.experts.apply(
                result.hidden_states, result.topk_ids, result.topk_weights
            )

        dbo_maybe_run_recv_hook()
        issue_ns = time.perf_counter_ns()
        combine = self.prepare_finalize.finalize(expert_output, result.metadata, async_op=is_async)
        _record_issue("combine", issue_ns, combine)
        shared_output = None
        if shared_experts is not None:
            # Runs while the combine is in flight (vLLM: before the yield, "C₁ send, S₁, MLP₀").
            with timeline_span("shared_experts"):
                shared_output = shared_experts(hidden_states)
        if is_async:
            dbo_register_recv_hook(_recv_hook(combine, "combine"))
            dbo_yield()
        output = _wait(combine, "combine")
        _record_comm("combine", combine)
        # The combine as this ubatch sees it, from issue to taking the result: the window the
        # shared experts overlap (the ``combine`` span ends at data arrival, which on one host can
        # come before the shared experts finish). Category "window": neither compute nor
        # communication in the overlap metrics, only drawn on the comm track.
        record_span(
            "combine_window", cat="window", start_ns=combine.issued_at_ns,
            end_ns=time.perf_counter_ns(), kind="comm",
        )  # fmt: skip
        if shared_output is not None:
            output = output + shared_output
        return output

    __call__ = forward
