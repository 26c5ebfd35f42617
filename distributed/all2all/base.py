"""The expert all-to-all of vLLM's modular kernel, ``[Router] → [Prepare/Dispatch] → [Experts]
→ [Finalize/Combine]``: one ``FusedMoEPrepareAndFinalize`` subclass per communication pattern.

Prepare and finalize live in one class because finalize undoes what prepare did, from the frozen
metadata prepare returned: nothing is stashed on ``self``, so two ubatch threads share one object.
Global expert ``e`` lives on EP rank ``e // num_local_experts``.
"""

from __future__ import annotations

import copy
import datetime
import enum
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.token_packing import RowLayout
from distributed.collectives import Pending
from distributed.comm_handle import (
    CollectiveHandle,
    CommHandle,
    CommTiming,
)
from distributed.communicator import Communicator, as_communicator
from distributed.link_emulation import EmulatedLink

T = TypeVar("T")

# ``implementation`` of DeepEP's own kernels: their completion is on the GPU stream
DEEPEP_KERNELS = "deep_ep kernels"
# "1": the per-call checks of the MoE path run (every dispatch, result, experts call and combine
# checks its arguments; every dispatch checks its expert ids on the host, a device sync)
DEBUG_CHECKS_ENV = "MOE_DBO_DEBUG_CHECKS"


def debug_checks_enabled() -> bool:
    """Whether ``MOE_DBO_DEBUG_CHECKS`` asks for the per-call checks (read at call time: the
    objects that run them read it once, when built)."""
    return os.environ.get(DEBUG_CHECKS_ENV, "0").strip().lower() in ("1", "true", "yes")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the partial sums of a combine, float64 for float64 inputs (exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


class FusedMoEActivationFormat(enum.Enum):
    """The layout a dispatch delivers and its combine takes back (vLLM's names): ``Standard``
    (``DispatchResult``; the experts return one weighted sum per row) or ``BatchedExperts``
    (``BatchedDispatchResult``, per local expert; UNWEIGHTED outputs in that layout)."""

    Standard = "standard"
    BatchedExperts = "batched_experts"


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchRequest:
    """One dispatch, what ``FusedMoEPrepareAndFinalize.prepare`` issues."""

    hidden_states: Tensor  # [num_tokens, hidden_size], float32/bfloat16/float16/float64
    topk_ids: Tensor  # [num_tokens, num_topk] int64 GLOBAL expert ids, -1 = no selection
    topk_weights: Tensor  # [num_tokens, num_topk] floating
    layout: RowLayout  # the packed row format of these tokens
    # every EP rank's num_tokens when the DP ranks agreed on them (under DBO), else None
    num_tokens_across_ep: tuple[int, ...] | None

    @property
    def num_tokens(self) -> int:
        return self.hidden_states.shape[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchMetadata:
    """What combine needs to route expert outputs back; each pattern adds its routing fields."""

    backend: str
    ep_rank: int
    num_tokens: int  # tokens this rank dispatched (rows of the combine result)
    hidden_size: int
    dtype: torch.dtype  # of the dispatched hidden states and of the combine result


@dataclass(frozen=True, slots=True, kw_only=True)
class StandardDispatchMetadata(DispatchMetadata):
    num_recv_tokens: int  # rows this rank received (rows of the expert output)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchedDispatchMetadata(DispatchMetadata):
    max_tokens_per_expert: int  # rows per local expert in the received layout, valid or not


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchResult:
    """Tokens received by this EP rank (``Standard``); pass ``metadata`` back to ``combine``."""

    hidden_states: Tensor  # [num_recv_tokens, hidden_size], dtype of the dispatched input
    topk_ids: Tensor  # [num_recv_tokens, num_topk] int64 LOCAL ids, -1 = expert elsewhere
    topk_weights: Tensor  # [num_recv_tokens, num_topk] float32, 0 where topk_ids == -1
    metadata: StandardDispatchMetadata

    def check(self) -> None:
        """ValueError unless the tensors have the shapes ``metadata`` gives (debug checks)."""
        n = self.metadata.num_recv_tokens
        if self.hidden_states.shape != (n, self.metadata.hidden_size):
            raise ValueError(
                f"hidden_states must be [{n}, {self.metadata.hidden_size}], "
                f"got {list(self.hidden_states.shape)}"
            )
        if self.topk_ids.shape != self.topk_weights.shape or self.topk_ids.shape[0] != n:
            raise ValueError(
                f"topk_ids {list(self.topk_ids.shape)} and topk_weights "
                f"{list(self.topk_weights.shape)} must both be [{n}, num_topk]"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchedDispatchResult:
    """Tokens received by this EP rank grouped per local expert (``BatchedExperts``); pass
    ``metadata`` back to ``combine`` with the UNWEIGHTED expert outputs."""

    # [num_local_experts, max_tokens_per_expert, hidden_size], dtype of the dispatched input;
    # rows past expert_num_tokens[l] are unspecified
    hidden_states: Tensor
    expert_num_tokens: Tensor  # [num_local_experts] int32 valid rows per local expert
    metadata: BatchedDispatchMetadata

    def check(self) -> None:
        """ValueError unless the tensors have the shapes ``metadata`` gives (debug checks)."""
        num_local_experts = self.expert_num_tokens.shape[0] if self.expert_num_tokens.dim() else -1
        expected = (num_local_experts, self.metadata.max_tokens_per_expert)
        expected += (self.metadata.hidden_size,)
        if self.expert_num_tokens.dim() != 1 or self.hidden_states.shape != expected:
            raise ValueError(
                f"hidden_states must be [num_local_experts, max_tokens_per_expert, hidden_size] = "
                f"{list(expected)} and expert_num_tokens [num_local_experts], got "
                f"{list(self.hidden_states.shape)} and {list(self.expert_num_tokens.shape)}"
            )


def collective_handle(
    pending: Pending,
    finalize: Callable[[], T],
    *,
    op: str,
    rank: int,
    timeout: datetime.timedelta,
    timing: CommTiming,
) -> CollectiveHandle[T]:
    """The handle of the issued collective ``pending``; its after-step (a fallback collective's)
    runs before ``finalize``."""
    work, after = pending

    def run_finalize() -> T:
        if after is not None:
            after()
        return finalize()

    return CollectiveHandle(
        op=op, rank=rank, timeout=timeout, work=work, finalize=run_finalize, timing=timing
    )


def complete_exchange(
    pending: Pending,
    *,
    op: str,
    rank: int,
    timeout: datetime.timedelta,
    num_bytes: int,
    start_ns: int,
    link: EmulatedLink | None,
) -> tuple[int, int]:
    """Wait for the small exchange ``pending`` issued at ``start_ns`` (a count exchange: DeepEP's
    notify), behind ``link`` as a transfer when there is one; its ``(start, end)`` in ns."""
    timing = CommTiming(issued_at_ns=start_ns, num_bytes=num_bytes)
    handle = collective_handle(
        pending, lambda: None, op=op, rank=rank, timeout=timeout, timing=timing
    )
    if link is not None:
        handle = link.delayed(handle)
    handle.wait()  # blocking wait (timeout: the handle's, after the link's deadline)
    return start_ns, time.perf_counter_ns()


class FusedMoEPrepareAndFinalize(ABC):
    """Dispatch tokens to the EP ranks holding their experts and combine the outputs back.

    A pattern implements ``prepare`` (issue a ``DispatchRequest``) and ``finalize`` (issue the
    combine); ``dispatch`` and ``combine`` put the transfers behind the emulated link if any, and
    complete them unless ``async_op``. Collective: every EP rank calls them in the same order,
    also with 0 tokens. Never mutated after ``__init__``.

    Per-call checks run only with ``debug_checks`` (``MOE_DBO_DEBUG_CHECKS=1`` when built): the
    arguments of ``dispatch`` and ``combine`` and every dispatch's result on arrival. The modular
    kernel makes them consistent by construction, and they would cost every layer of every ubatch.

    Args:
        ep_group: the EP group's communicator, or its process group (torch.distributed's); None
            only when ``ep_size == 1``: local copies.
        ep_rank, ep_size: this rank and the number of EP ranks.
        num_experts: global experts; rank ``r`` holds ``[r * num_local_experts, (r+1) * ...)``.
        timeout: limit of every blocking wait.
        check_topk_ids: check every dispatch's ``topk_ids`` against ``[0, num_experts)`` (ValueError
            naming the values found). It reads them to the host, a device sync inside the ubatch
            ping-pong, so it is off by default: the router makes ids in range by construction.
            None: as ``debug_checks``.

    Raises:
        ValueError: ``num_experts`` not a positive multiple of ``ep_size``, ``ep_rank`` outside
            ``[0, ep_size)``, no ``ep_group`` with ``ep_size > 1``, or ``timeout <= 0``.
    """

    name: ClassVar[str]  # the registry key (and the --all2all-backend choice)
    activation_format: ClassVar[FusedMoEActivationFormat]
    # constructor arguments only this class takes; make_prepare_finalize passes them to it alone
    extra_options: ClassVar[tuple[str, ...]] = ()
    # False only without expert parallelism: nothing moves
    moves_tokens: ClassVar[bool] = True
    # whether dispatch blocks on a count exchange even when num_tokens_across_ep is given
    blocks_under_dbo: ClassVar[bool] = False
    implementation: str = "torch.distributed"  # which code moves the bytes (logs, summary line)
    max_num_ubatches: int | None = None  # ubatches with transfers in flight at once (None: any)
    link: EmulatedLink | None = None  # set by ``with_link``

    def __init__(
        self,
        *,
        ep_group: ProcessGroup | Communicator | None,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        timeout: datetime.timedelta,
        check_topk_ids: bool | None = None,
    ) -> None:
        if ep_size < 1 or not 0 <= ep_rank < ep_size:
            raise ValueError(f"need ep_size >= 1 and ep_rank in [0, {ep_size}), got {ep_rank}")
        if num_experts < 1 or num_experts % ep_size != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size})"
            )
        if ep_group is None and ep_size > 1:
            raise ValueError(f"ep_group is required when ep_size > 1 (ep_size={ep_size})")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be > 0 s, got {timeout}")
        self.ep_group = as_communicator(ep_group)  # its collectives (shared memory, gloo, NCCL)
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.timeout = timeout
        self.debug_checks = debug_checks_enabled()
        self.check_topk_ids = self.debug_checks if check_topk_ids is None else check_topk_ids

    def __repr__(self) -> str:
        return type(self).__name__

    def with_link(self, link: EmulatedLink):
        """A copy of this object (same groups and buffers) whose every transfer, count exchange
        included, completes no earlier than ``link``'s deadline (``--emulate-link``). ValueError
        on DeepEP's kernels: they complete on the GPU stream, not in a host wait to delay."""
        if self.implementation == DEEPEP_KERNELS:
            raise ValueError(
                f"--emulate-link applies to the torch.distributed implementations only, not to "
                f"{self.name} on {DEEPEP_KERNELS}"
            )
        linked = copy.copy(self)
        linked.link = link
        return linked

    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult] | CommHandle[BatchedDispatchResult]:
        """Send each token to the EP ranks holding its experts.

        Args:
            hidden_states, topk_ids, topk_weights, num_tokens_across_ep: as ``DispatchRequest``,
                with the same hidden_size, num_topk and dtype on every EP rank (0 tokens allowed).
                Known counts spare a pattern whose count exchange only learns them that exchange.
            async_op: True: the payload stays in flight (a count exchange before it blocks, as
                DeepEP's notify does); False: the handle comes back complete.

        Returns:
            A handle of the rows this rank computes, in ``activation_format``.

        Raises:
            ValueError: a row format that differs across EP ranks (patterns that exchange one).
                With ``debug_checks``: TypeError / ValueError on bad shapes, dtypes or counts;
                with ``check_topk_ids``: ValueError on expert ids out of range.
            TimeoutError / RuntimeError: a collective failed.
        """
        counts = None if num_tokens_across_ep is None else tuple(map(int, num_tokens_across_ep))
        if self.debug_checks:
            self._check_tokens(hidden_states, topk_ids, topk_weights)
            self._check_counts(counts, hidden_states.shape[0])
        if self.check_topk_ids:
            self._check_topk_ids(topk_ids)
        layout = RowLayout(
            hidden_size=hidden_states.shape[1],
            num_topk=topk_ids.shape[1],
            dtype=hidden_states.dtype,
        )
        request = DispatchRequest(
            hidden_states=hidden_states,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            layout=layout,
            num_tokens_across_ep=counts,
        )
        return self._issue(lambda: self.prepare(request), async_op)

    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        """Send the expert outputs back and sum them per token.

        Args:
            expert_output: ``Standard``: ``[num_recv_tokens, hidden_size]``, each row's weighted
                sum over its local top-k; ``BatchedExperts``: ``[num_local_experts,
                max_tokens_per_expert, hidden_size]`` UNWEIGHTED (combine applies the weights).
            metadata: ``result.metadata`` of the matching dispatch on this object.

        Returns:
            A handle of ``[num_tokens, hidden_size]`` in the dispatched order and dtype, summed in
            float32 (float64 for float64).

        Raises:
            ValueError: with ``debug_checks``, a shape or metadata mismatch.
            TimeoutError / RuntimeError: comm failure.
        """
        if self.debug_checks:
            self._check_combine(expert_output, metadata)
        return self._issue(lambda: self.finalize(expert_output, metadata), async_op)

    @abstractmethod
    def prepare(
        self, request: DispatchRequest
    ) -> CommHandle[DispatchResult] | CommHandle[BatchedDispatchResult]:
        """Issue the dispatch of ``request``; the handle may still be in flight."""

    @abstractmethod
    def finalize(self, expert_output: Tensor, metadata: DispatchMetadata) -> CommHandle[Tensor]:
        """Issue the combine of ``expert_output``; the handle may still be in flight."""

    def _issue(self, issue: Callable[[], CommHandle[T]], async_op: bool) -> CommHandle[T]:
        """``issue()``'s handle, behind the link when there is one; complete unless ``async_op``."""
        handle = issue() if self.link is None else self.link.delayed(issue())
        if not async_op:
            handle.wait()  # blocking wait (timeout: self.timeout, after the link's deadline)
        return handle

    def _handle(self, pending: Pending, finalize: Callable[[], T], *, op: str, timing: CommTiming):
        """The ``CollectiveHandle`` of this rank's issued payload ``pending``; with
        ``debug_checks`` a dispatch's result is checked when ``finalize`` makes it."""
        if self.debug_checks:
            finalize = _checking(finalize)
        return collective_handle(
            pending, finalize, op=op, rank=self.ep_rank, timeout=self.timeout, timing=timing
        )

    def _metadata(self, cls: type, request: DispatchRequest, **fields):
        """A ``cls`` (a ``DispatchMetadata``) of ``request`` on this rank, with ``fields``."""
        layout = request.layout
        return cls(
            backend=self.name,
            ep_rank=self.ep_rank,
            num_tokens=request.num_tokens,
            hidden_size=layout.hidden_size,
            dtype=layout.dtype,
            **fields,
        )

    def _check_tokens(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
        """TypeError unless the dispatched tokens are well formed (debug checks)."""
        if hidden_states.dim() != 2 or not hidden_states.is_floating_point():
            raise TypeError(
                f"hidden_states must be a 2-D floating tensor [num_tokens, hidden_size], got "
                f"{list(hidden_states.shape)} {hidden_states.dtype}"
            )
        num_tokens = hidden_states.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype != torch.int64:
            raise TypeError(
                f"topk_ids must be int64 [{num_tokens}, num_topk], got "
                f"{list(topk_ids.shape)} {topk_ids.dtype}"
            )
        if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
            raise TypeError(
                f"topk_weights must be floating {list(topk_ids.shape)}, got "
                f"{list(topk_weights.shape)} {topk_weights.dtype}"
            )

    def _check_topk_ids(self, topk_ids: Tensor) -> None:
        """ValueError unless ``topk_ids`` lie in ``[0, num_experts)`` or are -1."""
        # host sync (small): only with check_topk_ids (debug)
        if topk_ids.numel() and bool(((topk_ids < -1) | (topk_ids >= self.num_experts)).any()):
            raise ValueError(
                f"topk_ids must be in [0, {self.num_experts}) or -1, got values in "
                f"[{int(topk_ids.min())}, {int(topk_ids.max())}]"
            )

    def _check_counts(self, counts: tuple[int, ...] | None, num_tokens: int) -> None:
        """ValueError unless ``counts`` (``num_tokens_across_ep``), when given, has ``ep_size``
        counts >= 0 and this rank's equals its ``num_tokens``."""
        if counts is None:
            return
        if len(counts) != self.ep_size or counts[self.ep_rank] != num_tokens or min(counts) < 0:
            raise ValueError(
                f"num_tokens_across_ep={list(counts)} must list {self.ep_size} counts >= 0 with "
                f"entry {self.ep_rank} equal to this rank's num_tokens={num_tokens}"
            )

    def _check_combine(self, expert_output: Tensor, metadata: DispatchMetadata) -> None:
        """ValueError unless ``metadata`` comes from this pattern and rank and ``expert_output``
        is floating in the layout of ``activation_format``."""
        if metadata.backend != self.name or metadata.ep_rank != self.ep_rank:
            raise ValueError(
                f"metadata must come from dispatch on this {self.name!r} backend at ep_rank "
                f"{self.ep_rank}, got {type(metadata).__name__} from {metadata.backend!r} at "
                f"ep_rank {metadata.ep_rank}"
            )
        if isinstance(metadata, BatchedDispatchMetadata):
            dims = "num_local_experts, max_tokens_per_expert, hidden_size"
            expected = (self.num_local_experts, metadata.max_tokens_per_expert)
        else:
            assert isinstance(metadata, StandardDispatchMetadata)  # the two formats' metadata
            dims, expected = "num_recv_tokens, hidden_size", (metadata.num_recv_tokens,)
        expected += (metadata.hidden_size,)
        if expert_output.shape != expected or not expert_output.is_floating_point():
            raise ValueError(
                f"expert_output must be floating {list(expected)} ({dims}), "
                f"got {list(expert_output.shape)} {expert_output.dtype}"
            )


def _checking(finalize: Callable[[], T]) -> Callable[[], T]:
    """``finalize``, then the ``check()`` of its result where it is a dispatch's."""

    def run() -> T:
        result = finalize()
        if isinstance(result, (DispatchResult, BatchedDispatchResult)):
            result.check()
        return result

    return run
