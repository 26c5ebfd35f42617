"""Prepare/finalize of the modular fused-MoE kernel: the dispatch before the experts and the
combine after them, as one class per communication pattern.

Prepare and finalize live in ONE class (``FusedMoEPrepareAndFinalize``) because they are two halves
of one pattern: finalize must undo exactly what prepare did (send tokens out, bring results back in
the caller's order), using the metadata prepare returned; nothing is stashed on ``self`` in between
(vLLM's ``FusedMoEPrepareAndFinalize``). Each declares the ``activation_format`` prepare
delivers and finalize takes back; the modular kernel checks at construction that its experts take
it. ``NoEPPrepareAndFinalize`` keeps every token local (EP size 1, ``Standard``);
``All2AllPrepareAndFinalize`` wraps an expert all-to-all backend (``distributed.all2all``; the
backend's format) whose transfers the kernel overlaps under DBO.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from distributed import (
    BatchedDispatchResult,
    CommHandle,
    CompletedHandle,
    DispatchMetadata,
    DispatchResult,
    FusedMoEActivationFormat,
    StandardDispatchMetadata,
)

if TYPE_CHECKING:
    from distributed import BatchedAll2AllBackend, StandardAll2AllBackend


class FusedMoEPrepareAndFinalize(ABC):
    """Moves tokens to the ranks that own their experts (prepare) and results back (finalize)."""

    def __repr__(self) -> str:
        return type(self).__name__

    @property
    @abstractmethod
    def activation_format(self) -> FusedMoEActivationFormat:
        """The layout ``prepare`` delivers and ``finalize`` takes back (``distributed.all2all.base``)."""

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
    ) -> CommHandle[DispatchResult] | CommHandle[BatchedDispatchResult]:
        """Dispatch tokens to their experts' ranks.

        Args:
            hidden_states: [num_tokens, hidden_size] (num_tokens may be 0).
            topk_ids: [num_tokens, num_topk] int64 GLOBAL expert ids.
            topk_weights: [num_tokens, num_topk] float32.
            async_op: leave the payload in flight; ``wait()`` completes it.
            num_tokens_across_ep: every EP rank's num_tokens, when already agreed (under DBO); a
                backend may then skip its blocking count exchange.

        Returns:
            A handle whose ``wait()`` gives the rows this rank must compute in
            ``activation_format``'s layout and the metadata ``finalize`` needs: a
            ``DispatchResult`` (rows with LOCAL expert ids, -1 = slot not on this rank) or a
            ``BatchedDispatchResult`` (rows grouped per local expert).
        """

    @abstractmethod
    def finalize(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool
    ) -> CommHandle[Tensor]:
        """Send expert results back; ``wait()`` gives [num_tokens, hidden_size] in the caller's
        original token order (the weighted sum over all top-k experts).

        ``expert_output``: ``Standard``: ``[num_recv_tokens, hidden_size]`` weighted sums per
        received row; ``BatchedExperts``: ``[num_local_experts, max_tokens_per_expert,
        hidden_size]`` UNWEIGHTED outputs (finalize applies the top-k weights).
        """


class NoEPPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """ep_size == 1: this rank holds every expert, so prepare and finalize move nothing.

    Global ids equal local ids; handles come back already completed.
    """

    def __init__(self, *, num_experts: int):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self._num_experts = num_experts

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

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
            metadata=StandardDispatchMetadata(
                backend="no_ep",
                ep_rank=0,
                num_tokens=num_tokens,
                num_recv_tokens=num_tokens,
                hidden_size=hidden_size,
                dtype=hidden_states.dtype,
            ),
        )
        return CompletedHandle(result)

    def finalize(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool
    ) -> CommHandle[Tensor]:
        return CompletedHandle(expert_output)


class All2AllPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """Expert parallelism through a ``distributed.All2AllBackend`` (dispatch / combine), in the
    backend's activation format."""

    def __init__(self, backend: StandardAll2AllBackend | BatchedAll2AllBackend):
        self.backend = backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.backend).__name__})"

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return self.backend.activation_format

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
    ) -> CommHandle[DispatchResult] | CommHandle[BatchedDispatchResult]:
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
