"""Modular fused-MoE kernel (after vLLM's ``FusedMoEModularKernel``): one MoE layer's token flow,
``[Router] → [Prepare/Dispatch] → [Experts] → [Finalize/Combine]``, with DBO's yield points. The
router runs in ``FusedMoE``; ``FusedMoEModularKernel`` owns the other three stages. Under DBO a
transfer's ``wait`` goes to another ubatch as a recv hook: docs/dbo.md#how-it-works-here,
docs/dbo.md#transfer-order-on-cpu."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

from dbo.forward_context import current_num_tokens_across_ep
from dbo.timeline.recorder import timeline_span
from dbo.timeline.transfers import record_transfer, transfer_result
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


def _recv_hook(handle: CommHandle) -> Callable[[], None]:
    """``handle.wait`` as a recv hook, under the grad mode of the issue: the other ubatch may run
    it at its ``__exit__``, outside the caller's ``torch.inference_mode``, where finalizing in
    place would raise "Inplace update to inference tensor outside InferenceMode"."""
    is_inference = torch.is_inference_mode_enabled()

    def hook() -> None:
        with torch.inference_mode(is_inference):
            handle.wait()

    return hook


def _on_comm_stream(issue: Callable[[], CommHandle]) -> CommHandle:
    """``issue()`` on this ubatch's comm stream (CUDA under DBO; no streams on CPU)."""
    dbo_switch_to_comm()
    handle = issue()
    dbo_switch_to_compute()
    return handle


def _complete(handle: CommHandle[T], is_async: bool) -> T:
    """The transfer's result: under DBO hand its ``wait`` to the ubatch that runs next as a recv
    hook and yield first; then take it (blocking unless the hook completed it)."""
    if is_async:
        dbo_register_recv_hook(_recv_hook(handle))
        dbo_yield()
    return transfer_result(handle)


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

    def _issue(
        self, op: str, issue: Callable[[], CommHandle], *, record_window: bool = False
    ) -> CommHandle:
        """Issue the transfer ``op`` on this ubatch's comm stream (``record_transfer``: the
        timeline's spans); the transfer handed to this ubatch completes before ours in vLLM's
        order, after in the CPU's."""
        if not self.issue_before_recv_hook:
            dbo_maybe_run_recv_hook()
        handle = record_transfer(op, lambda: _on_comm_stream(issue), record_window=record_window)
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
        result = _complete(dispatch, is_async)
        with timeline_span("experts"):
            expert_output = self._apply_experts(result)
        combine = self._issue(
            "combine",
            lambda: self.prepare_finalize.combine(
                expert_output, result.metadata, async_op=is_async
            ),
            record_window=True,  # the window the shared experts overlap
        )
        shared_output = None
        if shared_experts is not None:
            # Runs while the combine is in flight (vLLM: before the yield, "C₁ send, S₁, MLP₀").
            with timeline_span("shared_experts"):
                shared_output = shared_experts(hidden_states)
        output = _complete(combine, is_async)
        if shared_output is not None:
            output = output + shared_output
        return output

    __call__ = forward
