"""Results and the abstract interfaces of the expert all-to-all (dispatch / combine).

A backend delivers the received tokens in one of two activation formats
(``FusedMoEActivationFormat``, vLLM's names), and the experts must take that format:

- ``Standard`` (``StandardAll2AllBackend``), after DeepEP's high-throughput ``Buffer.dispatch`` /
  ``Buffer.combine``: dispatch sends each token once to every EP rank holding at least one of its
  top-k experts, with its ``topk_ids`` rewritten to that rank's LOCAL expert ids (-1 elsewhere)
  and its ``topk_weights``; the experts return one weighted sum per received row; combine sends
  the rows back and sums a token's partial outputs over the ranks, in the token's original order.
- ``BatchedExperts`` (``BatchedAll2AllBackend``), after DeepEP's ``low_latency_dispatch`` /
  ``low_latency_combine``: rows grouped per local expert with per-expert counts; the experts
  return UNWEIGHTED outputs in that layout and combine applies the top-k weights.

A backend object holds no per-call state: everything combine needs travels in the frozen
``DispatchMetadata``.
"""

from __future__ import annotations

import datetime
import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.token_packing import RowLayout
from distributed.comm_handle import (
    CollectiveHandle,
    CommHandle,
    CommTiming,
    wait_blocking_exchange,
)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype combine sums partial expert outputs in: float32, or float64 for float64 inputs
    (the exactness tests run the whole model in float64)."""
    return torch.promote_types(dtype, torch.float32)


class FusedMoEActivationFormat(enum.Enum):
    """Layout in which a dispatch delivers tokens to the experts (vLLM's
    ``FusedMoEActivationFormat``).

    ``Standard``: ``DispatchResult``, rows ``[num_recv_tokens, hidden_size]`` with LOCAL top-k ids
    and weights; the experts return ``[num_recv_tokens, hidden_size]`` weighted sums.
    ``BatchedExperts``: ``BatchedDispatchResult``, rows ``[num_local_experts,
    max_tokens_per_expert, hidden_size]`` with per-expert counts; the experts return UNWEIGHTED
    outputs in the same layout and combine applies the top-k weights.
    """

    Standard = "standard"
    BatchedExperts = "batched_experts"


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchMetadata:
    """What combine needs to route expert outputs back; opaque to callers.

    Each backend subclasses the metadata of its activation format with its own routing fields.
    """

    backend: str
    ep_rank: int
    num_tokens: int  # tokens this rank dispatched (rows of the combine result)
    hidden_size: int
    dtype: torch.dtype  # dtype of the dispatched hidden states and of the combine result


@dataclass(frozen=True, slots=True, kw_only=True)
class StandardDispatchMetadata(DispatchMetadata):
    """Metadata of a ``Standard`` dispatch."""

    num_recv_tokens: int  # rows this rank received (rows of the expert output)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchedDispatchMetadata(DispatchMetadata):
    """Metadata of a ``BatchedExperts`` dispatch."""

    # rows per local expert in the received layout (valid or not): dim 1 of the expert output
    max_tokens_per_expert: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchResult:
    """Tokens received by this EP rank (``Standard`` activation format).

    Attributes:
        hidden_states: ``[num_recv_tokens, hidden_size]``, dtype of the dispatched input.
        topk_ids: ``[num_recv_tokens, num_topk]`` torch.int64 LOCAL expert ids in
            ``[0, num_local_experts)``; -1 = that top-k slot is not on this rank.
        topk_weights: ``[num_recv_tokens, num_topk]`` torch.float32, 0 where ``topk_ids == -1``.
        metadata: pass it back to ``combine``.
    """

    hidden_states: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    metadata: StandardDispatchMetadata

    def __post_init__(self) -> None:
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
    """Tokens received by this EP rank, grouped per local expert (``BatchedExperts`` activation
    format: DeepEP's low-latency layout).

    Attributes:
        hidden_states: ``[num_local_experts, max_tokens_per_expert, hidden_size]``, dtype of the
            dispatched input; only the first ``expert_num_tokens[l]`` rows of expert ``l`` are
            valid (the rest is unspecified).
        expert_num_tokens: ``[num_local_experts]`` torch.int32 valid rows per local expert.
        metadata: pass it back to ``combine``, with the experts' UNWEIGHTED outputs in the same
            layout (combine applies the top-k weights).
    """

    hidden_states: Tensor
    expert_num_tokens: Tensor
    metadata: BatchedDispatchMetadata

    def __post_init__(self) -> None:
        num_local_experts = self.expert_num_tokens.shape[0] if self.expert_num_tokens.dim() else -1
        expected = (num_local_experts, self.metadata.max_tokens_per_expert)
        expected += (self.metadata.hidden_size,)
        if self.expert_num_tokens.dim() != 1 or self.hidden_states.shape != expected:
            raise ValueError(
                f"hidden_states must be [num_local_experts, max_tokens_per_expert, hidden_size] = "
                f"{list(expected)} and expert_num_tokens [num_local_experts], got "
                f"{list(self.hidden_states.shape)} and {list(self.expert_num_tokens.shape)}"
            )


class All2AllBackend(ABC):
    """Expert-parallel dispatch / combine over ``ep_group``: what every backend shares (groups,
    sizes, checks, class-level declarations). A backend subclasses the base of the activation
    format it delivers, ``StandardAll2AllBackend`` or ``BatchedAll2AllBackend``, which declare
    ``dispatch`` and ``combine`` with that format's types.

    Collective: every EP rank calls ``dispatch`` and ``combine`` in the same order (also with 0
    tokens). Safe to share between two ubatch threads that issue calls alternately: the object is
    never mutated after ``__init__``.

    Args:
        ep_group: the EP process group (None allowed only when ``ep_size == 1``: local copies).
        ep_rank, ep_size: this rank and the number of EP ranks.
        num_experts: global experts; rank ``r`` holds ``[r * num_local_experts, (r+1) * ...)``.
        timeout: limit of every blocking wait.

    Raises:
        ValueError: if ``num_experts % ep_size != 0``, ``ep_rank`` is outside ``[0, ep_size)``,
            ``ep_group`` is None with ``ep_size > 1``, or ``timeout <= 0``.
    """

    name: ClassVar[str]
    # the layout dispatch delivers and combine takes back (set by the two format bases below)
    activation_format: ClassVar[FusedMoEActivationFormat]
    # constructor arguments beyond ``All2AllBackend``'s that this backend takes;
    # ``make_all2all_backend`` passes them only to the backends that declare them
    extra_options: ClassVar[tuple[str, ...]] = ()
    # which code moves the bytes (start-up log and summary line)
    implementation: str = "torch.distributed"
    # whether dispatch blocks on a count exchange even when num_tokens_across_ep is given
    blocks_under_dbo: ClassVar[bool] = False
    # how many ubatches may have a dispatch or combine in flight at once (None: any number);
    # DeepEP's low-latency kernels double-buffer, so their results allow two
    max_num_ubatches: int | None = None

    def __init__(
        self,
        *,
        ep_group: ProcessGroup | None,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        timeout: datetime.timedelta,
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
        self.ep_group = ep_group
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.timeout = timeout

    # ---- shared helpers (no state) ----

    def _row_layout(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> RowLayout:
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
        # host sync (small): the routing needs counts on the host anyway
        if num_tokens and bool(((topk_ids < -1) | (topk_ids >= self.num_experts)).any()):
            raise ValueError(
                f"topk_ids must be in [0, {self.num_experts}) or -1, got values in "
                f"[{int(topk_ids.min())}, {int(topk_ids.max())}]"
            )
        return RowLayout(
            hidden_size=hidden_states.shape[1],
            num_topk=topk_ids.shape[1],
            dtype=hidden_states.dtype,
        )

    def _check_combine(self, expert_output: Tensor, metadata: DispatchMetadata, kind: type) -> None:
        """ValueError unless ``metadata`` is a ``kind`` from this backend and rank and
        ``expert_output`` is floating in the layout of ``activation_format``."""
        if not isinstance(metadata, kind) or metadata.ep_rank != self.ep_rank:
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

    def _check_num_tokens_across_ep(
        self, num_tokens_across_ep: Sequence[int] | None, num_tokens: int
    ) -> list[int] | None:
        """``num_tokens_across_ep`` as a list, checked against this rank; ValueError if it does not
        have ``ep_size`` entries or disagrees with this rank's own ``num_tokens``."""
        if num_tokens_across_ep is None:
            return None
        counts = [int(n) for n in num_tokens_across_ep]
        if len(counts) != self.ep_size or counts[self.ep_rank] != num_tokens or min(counts) < 0:
            raise ValueError(
                f"num_tokens_across_ep={counts} must list {self.ep_size} counts >= 0 with "
                f"entry {self.ep_rank} equal to this rank's num_tokens={num_tokens}"
            )
        return counts

    def _check_signatures(self, signatures: list[list[int]], layout: RowLayout, op: str) -> None:
        """Raise on every rank (before the payload) if EP ranks disagree on the row format."""
        expected = list(layout.signature())
        if any(sig != expected for sig in signatures):
            raise ValueError(
                f"{op} on ep_rank {self.ep_rank}: (hidden_size, num_topk, dtype code) differ across "
                f"EP ranks: {signatures}; every rank must dispatch the same hidden_size, num_topk "
                f"and dtype"
            )

    def _notify(self, pending, op: str, *, issued_at_ns: int, num_bytes: int) -> tuple[int, int]:
        """Complete the small blocking count exchange ``pending`` (issued at ``issued_at_ns``,
        ``num_bytes`` each way); return its ``(start, end)`` ns (``perf_counter_ns``)."""
        work, after = pending
        handle = CollectiveHandle(
            op=op,
            rank=self.ep_rank,
            timeout=self.timeout,
            work=work,
            finalize=after or (lambda: None),
            timing=CommTiming(issued_at_ns=issued_at_ns, num_bytes=num_bytes),
        )
        wait_blocking_exchange(handle)  # blocking wait (timeout: self.timeout)
        return issued_at_ns, time.perf_counter_ns()

    def _handle(self, *, op: str, pending, finalize, timing: CommTiming, async_op: bool):
        """The ``CollectiveHandle`` of a payload ``pending`` (its after-step runs before
        ``finalize``); complete when not ``async_op``."""
        work, after = pending

        def run_finalize():
            if after is not None:
                after()
            return finalize()

        handle = CollectiveHandle(
            op=op,
            rank=self.ep_rank,
            timeout=self.timeout,
            work=work,
            finalize=run_finalize,
            timing=timing,
        )
        if not async_op:
            handle.wait()  # blocking wait (timeout: self.timeout) inside CommHandle.wait
        return handle


class StandardAll2AllBackend(All2AllBackend):
    """A backend in the ``Standard`` activation format: dispatch delivers ``DispatchResult`` rows
    with LOCAL top-k ids and weights; combine takes one weighted sum per received row."""

    activation_format = FusedMoEActivationFormat.Standard

    @abstractmethod
    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult]:
        """Send each token to the EP ranks holding its experts.

        Args:
            hidden_states: ``[num_tokens, hidden_size]``, float32/bfloat16/float16/float64;
                ``num_tokens`` may be 0. Same hidden_size, num_topk and dtype on every EP rank.
            topk_ids: ``[num_tokens, num_topk]`` torch.int64 GLOBAL expert ids in
                ``[0, num_experts)``; -1 = no selection.
            topk_weights: ``[num_tokens, num_topk]`` float (used as float32).
            async_op: False: the returned handle is complete. True: the payload collective is in
                flight (the small count exchange before it blocks, like DeepEP's notify).
            num_tokens_across_ep: every EP rank's ``num_tokens`` in this dispatch, when the caller
                already knows them (under DBO the DP ranks agreed on padded ubatch sizes). A
                backend whose count exchange only learns these counts skips it, so the dispatch
                issues without blocking (vLLM's naive dispatcher uses the DP metadata the same way).

        Raises:
            ValueError / TypeError: bad shapes, dtypes, expert ids, or a row format that differs
                across EP ranks. TimeoutError / RuntimeError: a collective timed out or failed.
        """

    @abstractmethod
    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        """Send expert outputs back and sum them per token.

        Args:
            expert_output: ``[num_recv_tokens, hidden_size]``: per received row, the sum over its
                local top-k slots of ``topk_weight * expert(x)``.
            metadata: ``DispatchResult.metadata`` of the matching dispatch on this backend.

        Returns:
            Handle of ``[num_tokens, hidden_size]`` in the dispatching caller's token order and
            dtype: the sum over ranks of the partial outputs, accumulated in float32 (float64 for
            float64 inputs).

        Raises:
            ValueError: shape or metadata mismatch. TimeoutError / RuntimeError: comm failure.
        """


class BatchedAll2AllBackend(All2AllBackend):
    """A backend in the ``BatchedExperts`` activation format: dispatch delivers a
    ``BatchedDispatchResult`` (rows grouped per local expert, one row per (token, local expert)
    pair); combine takes the experts' UNWEIGHTED outputs in that layout and applies the top-k
    weights itself."""

    activation_format = FusedMoEActivationFormat.BatchedExperts

    @abstractmethod
    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[BatchedDispatchResult]:
        """Send each token to every local expert of every EP rank among its top-k.

        Args: as ``StandardAll2AllBackend.dispatch``; ``topk_weights`` travel in the metadata
        (combine applies them), not to the experts.

        Returns:
            Handle of a ``BatchedDispatchResult``: ``[num_local_experts, max_tokens_per_expert,
            hidden_size]`` rows and ``[num_local_experts]`` int32 valid counts.

        Raises:
            ValueError / TypeError: bad shapes, dtypes or expert ids, or more tokens than the
                backend's capacity. TimeoutError / RuntimeError: a collective timed out or failed.
        """

    @abstractmethod
    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        """Send expert outputs back, weight them by the dispatched top-k weights and sum per token.

        Args:
            expert_output: ``[num_local_experts, max_tokens_per_expert, hidden_size]`` floating,
                the UNWEIGHTED output of local expert ``l`` for its first
                ``expert_num_tokens[l]`` rows (rows past the count are ignored).
            metadata: ``BatchedDispatchResult.metadata`` of the matching dispatch on this backend.

        Returns:
            Handle of ``[num_tokens, hidden_size]`` in the dispatching caller's token order and
            dtype: ``sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x)``.

        Raises:
            ValueError: shape or metadata mismatch. TimeoutError / RuntimeError: comm failure.
        """
