"""One (u)batch's forward state, the only per-thread state of a forward (vLLM's
``vllm/forward_context.py``): ``ForwardContext``, ``DPMetadata``, ``set_forward_context`` and its
readers. Lifetime and the ubatch hand-over: docs/dbo.md, "Forward context"."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dbo.ubatch_context import UBatchContext

__all__ = [
    "DPMetadata",
    "ForwardContext",
    "current_forward_context",
    "current_num_tokens_across_ep",
    "get_forward_context",
    "is_forward_context_available",
    "set_forward_context",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DPMetadata:
    """Token counts of one (u)batch across the DP group, known once the DP ranks agreed on them
    (vLLM's ``DPMetadata``).

    Fields:
        num_tokens_across_dp: ``[dp_size]`` every DP rank's row count of this (u)batch, padding
            included.
        dp_rank_of_ep_rank: ``[ep_size]`` the DP rank whose rows EP rank ``e`` dispatches
            (``distributed.ParallelGroups.dp_rank_of_ep_rank``), or None when the layout is not
            known; then ``num_tokens_across_ep`` is None and the all-to-all exchanges the counts
            itself.
        num_tokens_across_ep: ``[ep_size]`` every EP rank's row count, derived from the two fields
            above (None without the mapping); computed once here, read by every MoE layer.

    Raises:
        ValueError: on a negative or empty count list, or a mapping entry outside
            ``[0, dp_size)``.
    """

    num_tokens_across_dp: tuple[int, ...]
    dp_rank_of_ep_rank: tuple[int, ...] | None = None
    num_tokens_across_ep: tuple[int, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        counts = tuple(int(n) for n in self.num_tokens_across_dp)
        if not counts or min(counts) < 0:
            raise ValueError(f"num_tokens_across_dp must be >= 1 counts >= 0, got {counts}")
        object.__setattr__(self, "num_tokens_across_dp", counts)
        if self.dp_rank_of_ep_rank is None:
            return
        ranks = tuple(int(r) for r in self.dp_rank_of_ep_rank)
        if not ranks or not all(0 <= r < len(counts) for r in ranks):
            raise ValueError(
                f"dp_rank_of_ep_rank must list >= 1 DP ranks in [0, {len(counts)}), got {ranks}"
            )
        object.__setattr__(self, "dp_rank_of_ep_rank", ranks)
        object.__setattr__(self, "num_tokens_across_ep", tuple(counts[r] for r in ranks))


@dataclass(slots=True, kw_only=True, eq=False)
class ForwardContext:
    """One (u)batch's forward state.

    Set by the caller:
        attn_metadata: this (u)batch's attention metadata (a ubatch's slice under DBO); None in
            the context a ``UBatchContext`` makes.
        dp_metadata: its token counts across DP (and EP); None when the DP ranks did not agree on
            them (the all-to-all then exchanges the counts itself).
        ubatch_id: the ubatch this context describes; None for a whole batch. Must match the
            thread's ubatch (``set_forward_context`` checks it).

    Filled in while it is current:
        ubatch: the thread's ``UBatchContext`` (taken over from the context it entered in).
        layer: the decoder layer this thread is in (``dbo.timeline.recorder.set_timeline_layer``),
            None outside one.
        graph_rows: graph mode: the real rows of the padded bucket running now, else None.

    Raises:
        ValueError: if ``ubatch_id`` is negative.
    """

    attn_metadata: Any = None
    dp_metadata: DPMetadata | None = None
    ubatch_id: int | None = None
    ubatch: UBatchContext | None = field(default=None, init=False)
    layer: int | None = field(default=None, init=False)
    graph_rows: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.ubatch_id is not None and self.ubatch_id < 0:
            raise ValueError(f"ubatch_id must be None or >= 0, got {self.ubatch_id}")


_local = threading.local()  # .context: this thread's current ForwardContext


def current_forward_context() -> ForwardContext | None:
    """This thread's current forward context, or None outside any (one attribute read)."""
    return getattr(_local, "context", None)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Within the block, ``get_forward_context()`` in this thread returns ``context``, which
    takes over the thread's ubatch and starts outside any layer; on exit the previous context
    (or none) is current again.

    Raises:
        ValueError: if ``context.ubatch_id`` is not this thread's ubatch (None outside a ubatch
            thread).
    """
    previous = current_forward_context()
    ubatch = None if previous is None else previous.ubatch
    running = None if ubatch is None else ubatch.id
    if context.ubatch_id != running:
        raise ValueError(
            f"a ForwardContext of ubatch {context.ubatch_id} set in a thread running "
            f"{'no ubatch' if running is None else f'ubatch {running}'}"
        )
    context.ubatch, context.layer, context.graph_rows = ubatch, None, None
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


def enter_ubatch(ubatch: UBatchContext) -> ForwardContext | None:
    """Make a context naming only ``ubatch`` current in this thread (``UBatchContext.__enter__``);
    returns the previous one, for ``restore_forward_context``.

    Raises:
        RuntimeError: if this thread already runs a ubatch.
    """
    previous = current_forward_context()
    if previous is not None and previous.ubatch is not None:
        raise RuntimeError(f"{ubatch!r} entered in a thread already in a ubatch context")
    context = ForwardContext(ubatch_id=ubatch.id)
    context.ubatch = ubatch
    _local.context = context
    return previous


def restore_forward_context(previous: ForwardContext | None) -> None:
    """Make ``previous`` (``enter_ubatch``'s result) current again in this thread."""
    _local.context = previous


def is_forward_context_available() -> bool:
    """Whether a forward context is set in this thread."""
    return current_forward_context() is not None


def get_forward_context() -> ForwardContext:
    """This thread's current forward context.

    Raises:
        RuntimeError: outside ``set_forward_context`` (not inside a forward).
    """
    context = current_forward_context()
    if context is None:
        raise RuntimeError("no forward context is set: call inside set_forward_context(...)")
    return context


def current_num_tokens_across_ep() -> tuple[int, ...] | None:
    """``[ep_size]`` every EP rank's row count of the current (u)batch, or None when unknown (no
    forward context, no DP agreement, or no DP-to-EP mapping): the all-to-all then exchanges the
    counts itself, or assumes its capacity."""
    context = current_forward_context()
    if context is None or context.dp_metadata is None:
        return None
    return context.dp_metadata.num_tokens_across_ep
