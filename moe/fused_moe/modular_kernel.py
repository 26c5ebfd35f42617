"""Modular fused-MoE kernel: one MoE layer's token flow, with DBO yield points (after vLLM's
``FusedMoEModularKernel``)::

    [Router] → [Prepare/Dispatch] → [Experts] → [Finalize/Combine]

The router runs in ``FusedMoE``; this module owns the other three stages. Under DBO (vLLM's
``forward``) dispatch and combine are issued asynchronously, their ``wait`` goes as a receive hook
to the ubatch that runs last before this one gets the baton back, and this ubatch yields; whoever
runs the hook first completes the transfer (docs/dbo.md#the-ping-pong-protocol).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

from dbo.forward_context import current_num_tokens_across_ep
from dbo.timeline.recorder import CAT_COMM, CAT_COMPUTE, CAT_WAIT, record_span, timeline_span
from dbo.ubatch_context import (
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_compute,
    dbo_yield,
)
from distributed import (
    BatchedDispatchResult,
    CommHandle,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
)
from moe.platforms.plugins import current_platform

if TYPE_CHECKING:
    from moe.fused_moe.experts import TorchExperts


T = TypeVar("T")


def _recv_hook(handle: CommHandle, op: str) -> Callable[[], None]:
    """``handle.wait`` as a recv hook, recorded as a ``wait`` span, under the grad mode of the
    issue: the other ubatch may run it at its ``__exit__``, outside the caller's
    ``torch.inference_mode``, where finalizing in place would raise "Inplace update to inference
    tensor outside InferenceMode"."""
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


def _span(name: str, cat: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
    """``record_span`` on this thread's compute track for compute spans, else its comm track."""
    kind = "compute" if cat == CAT_COMPUTE else "comm"
    record_span(name, cat=cat, start_ns=start_ns, end_ns=end_ns, kind=kind, args=args)


def _record_issue(op: str, start_ns: int, handle: CommHandle) -> None:
    """Spans of one issue: the CPU work before the payload leaves (``{op}_prep``, compute), split
    by the blocking count exchange if the backend made one (``{op}_notify``, comm)."""
    timing = handle.timing
    issued_at_ns = max(timing.issued_at_ns, start_ns)
    prep_end_ns = issued_at_ns if timing.notify_ns is None else timing.notify_ns[0]
    _span(f"{op}_prep", CAT_COMPUTE, start_ns, prep_end_ns)
    if timing.notify_ns is not None:
        notify_start, notify_end = timing.notify_ns
        _span(f"{op}_notify", CAT_COMM, notify_start, notify_end)
        _span(f"{op}_prep", CAT_COMPUTE, notify_end, issued_at_ns)


def _record_comm(op: str, handle: CommHandle) -> None:
    """Spans of one completed transfer: ``{op}`` from issue to data arrival (comm; behind an
    emulated link ``payload_ms`` is when the bytes were there) and the receive-side unpacking
    ``{op}_finish`` (compute no overlap hides, counted in C; in whichever ubatch completed it)."""
    timing = handle.timing
    args = {"num_bytes": timing.num_bytes}
    if timing.payload_at_ns is not None:  # behind an emulated link: when the bytes were there
        args["payload_ms"] = (timing.payload_at_ns - timing.issued_at_ns) / 1e6
    end_ns = timing.completed_at_ns or time.perf_counter_ns()
    _span(op, CAT_COMM, timing.issued_at_ns, end_ns, args)
    if timing.finish_ns is not None:
        _span(f"{op}_finish", CAT_COMPUTE, *timing.finish_ns)


def _record_combine_window(combine: CommHandle) -> None:
    """The combine from issue to taking the result, the window the shared experts overlap (the
    ``combine`` span ends at data arrival); category "window": drawn on the comm track, neither
    compute nor communication in the overlap metrics."""
    _span("combine_window", "window", combine.timing.issued_at_ns, time.perf_counter_ns())


def _complete(handle: CommHandle[T], op: str, is_async: bool) -> T:
    """The transfer's result: under DBO hand its ``wait`` to the ubatch that runs next as a recv
    hook and yield first; then wait (blocking unless a hook completed it) and record it."""
    if is_async:
        dbo_register_recv_hook(_recv_hook(handle, op))
        dbo_yield()
    result = _wait(handle, op)
    _record_comm(op, handle)
    return result


class FusedMoEModularKernel:
    """Dispatch → experts → combine for routed tokens, with the DBO yield/recv-hook protocol.

    ``issue_before_recv_hook``: at each transfer this ubatch completes the transfer handed to it
    and then issues its own (vLLM's order, ``False``), or issues its own first (``True``, the CPU's:
    a hook blocks there until the data arrive; docs/dbo.md#transfer-order-on-cpu). Default:
    ``Platform.issue_before_recv_hook``. Either order gives the same results.

    Raises:
        ValueError: the experts do not take the activation format prepare_finalize delivers (the
            message names both classes and formats), or the two serve different numbers of
            local experts.
    """

    def __init__(
        self,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        experts: TorchExperts,
        *,
        issue_before_recv_hook: bool | None = None,
    ):
        fmt = prepare_finalize.activation_format
        if fmt not in experts.activation_formats:
            raise ValueError(
                f"{type(experts).__name__} takes activation formats "
                f"{[f.value for f in experts.activation_formats]} but "
                f"{prepare_finalize!r} delivers {fmt.value!r}"
            )
        if prepare_finalize.num_local_experts != experts.num_local_experts:
            raise ValueError(
                f"prepare_finalize serves {prepare_finalize.num_local_experts} local experts but "
                f"experts holds {experts.num_local_experts}"
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        # the experts' entry point for this format, chosen once (not per call)
        self._apply_experts: Callable[..., Tensor] = (
            self._apply_batched
            if fmt is FusedMoEActivationFormat.BatchedExperts
            else self._apply_standard
        )
        if issue_before_recv_hook is None:
            issue_before_recv_hook = current_platform().issue_before_recv_hook
        self.issue_before_recv_hook = issue_before_recv_hook

    def _apply_standard(self, result: DispatchResult) -> Tensor:
        """``Standard``: weighted sums per received row."""
        return self.experts.apply_standard(
            result.hidden_states, result.topk_ids, result.topk_weights
        )

    def _apply_batched(self, result: BatchedDispatchResult) -> Tensor:
        """``BatchedExperts``: UNWEIGHTED per-expert outputs (combine applies the weights)."""
        return self.experts.apply_batched(result.hidden_states, result.expert_num_tokens)

    def _issue(self, op: str, issue: Callable[[], CommHandle]) -> CommHandle:
        """Issue one transfer on this ubatch's comm stream (CUDA under DBO) and record it; the
        transfer handed to this ubatch completes before ours in vLLM's order, after in the CPU's."""
        if not self.issue_before_recv_hook:
            dbo_maybe_run_recv_hook()
        issue_ns = time.perf_counter_ns()
        dbo_switch_to_comm()
        handle = issue()
        dbo_switch_to_compute()
        _record_issue(op, issue_ns, handle)
        if self.issue_before_recv_hook:
            dbo_maybe_run_recv_hook()  # ours is on the link; now complete the next ubatch's
        return handle

    def forward(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        shared_experts: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Routed-expert output (plus shared experts, when given) of every token.

        Args:
            hidden_states: [num_tokens, hidden_size]
            topk_ids: [num_tokens, num_topk] int64 GLOBAL expert ids
            topk_weights: [num_tokens, num_topk] float32
            shared_experts: optional dense MLP run on hidden_states while the combine is in flight.

        Returns:
            [num_tokens, hidden_size] in hidden_states' dtype.
        """
        is_async = dbo_enabled()
        dispatch = self._issue(
            "dispatch",
            lambda: self.prepare_finalize.dispatch(
                hidden_states,
                topk_ids,
                topk_weights,
                async_op=is_async,
                # the DP ranks agreed on every batch's / ubatch's size: no count exchange needed
                num_tokens_across_ep=current_num_tokens_across_ep(),
            ),
        )
        result = _complete(dispatch, "dispatch", is_async)
        with timeline_span("experts"):
            expert_output = self._apply_experts(result)
        combine = self._issue(
            "combine",
            lambda: self.prepare_finalize.combine(
                expert_output, result.metadata, async_op=is_async
            ),
        )
        shared_output = None
        if shared_experts is not None:
            # Runs while the combine is in flight (vLLM: before the yield, "C₁ send, S₁, MLP₀").
            with timeline_span("shared_experts"):
                shared_output = shared_experts(hidden_states)
        output = _complete(combine, "combine", is_async)
        _record_combine_window(combine)
        if shared_output is not None:
            output = output + shared_output
        return output

    __call__ = forward
