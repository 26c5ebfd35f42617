"""What one (u)batch's forward needs beyond its inputs (vLLM's ``vllm/forward_context.py``).

The model runner sets a ``ForwardContext`` around a whole batch's forward
(``set_forward_context``); under DBO each ubatch thread runs inside its own, built by the runner
and entered by ``dbo.UBatchWrapper`` in that thread. Layers read it with ``get_forward_context()``
(the MoE layer's EP token counts through ``current_num_tokens_across_ep()``).

The model's forward keeps its explicit ``attn_metadata`` argument, which the runner's model
function takes from the context: the model stays a plain function of its inputs, called directly
by the transformers-equality tests and traced by graph mode (``moe.compilation``, whose splitting
ops take the metadata as an argument). The context carries what the runner hands a (u)batch and
what a layer needs beyond its arguments (the MoE layer's EP token counts).

The context is thread-local: each ubatch runs in its own thread and sees only its own context;
nesting restores the outer one on exit. The current decoder layer, which names the timeline's
spans, stays the timeline's (``dbo.timeline.recorder.set_timeline_layer``: the timeline, in
``dbo``, is its only reader); ``set_forward_context`` scopes it, so a forward starts outside any
layer and leaves none behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from dbo.timeline.recorder import set_timeline_layer, timeline_layer
from dbo.ubatch_context import dbo_current_ubatch_id, dbo_enabled
from moe.layers.attention_metadata import CommonAttentionMetadata

__all__ = [
    "DPMetadata",
    "ForwardContext",
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardContext:
    """One (u)batch's forward state.

    Fields:
        attn_metadata: this (u)batch's attention metadata (a ubatch's slice under DBO).
        dp_metadata: its token counts across DP (and EP); None when the DP ranks did not agree on
            them (the all-to-all then exchanges the counts itself).
        ubatch_id: the ubatch this context describes; None for a whole batch. Must match the
            thread's DBO ubatch when set (``set_forward_context`` checks it).

    Raises:
        ValueError: if ``ubatch_id`` is negative.
    """

    attn_metadata: CommonAttentionMetadata
    dp_metadata: DPMetadata | None = None
    ubatch_id: int | None = None

    def __post_init__(self) -> None:
        if self.ubatch_id is not None and self.ubatch_id < 0:
            raise ValueError(f"ubatch_id must be None or >= 0, got {self.ubatch_id}")


_local = threading.local()  # .context: this thread's current ForwardContext


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Within the block, ``get_forward_context()`` in this thread returns ``context``; on exit
    the previous context (or none) and the previous timeline layer come back.

    Raises:
        ValueError: if ``context.ubatch_id`` is not this thread's DBO ubatch (None outside a
            ubatch thread).
    """
    ubatch_id = dbo_current_ubatch_id() if dbo_enabled() else None
    if context.ubatch_id != ubatch_id:
        raise ValueError(
            f"a ForwardContext of ubatch {context.ubatch_id} set in a thread running "
            f"{'no ubatch' if ubatch_id is None else f'ubatch {ubatch_id}'}"
        )
    previous, previous_layer = getattr(_local, "context", None), timeline_layer()
    _local.context = context
    set_timeline_layer(None)
    try:
        yield context
    finally:
        _local.context = previous
        set_timeline_layer(previous_layer)


def is_forward_context_available() -> bool:
    """Whether a forward context is set in this thread."""
    return getattr(_local, "context", None) is not None


def get_forward_context() -> ForwardContext:
    """This thread's current forward context.

    Raises:
        RuntimeError: outside ``set_forward_context`` (not inside a forward).
    """
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("no forward context is set: call inside set_forward_context(...)")
    return context


def current_num_tokens_across_ep() -> tuple[int, ...] | None:
    """``[ep_size]`` every EP rank's row count of the current (u)batch, or None when unknown (no
    forward context, no DP agreement, or no DP-to-EP mapping): the all-to-all then exchanges the
    counts itself, or assumes its capacity."""
    context = getattr(_local, "context", None)
    if context is None or context.dp_metadata is None:
        return None
    return context.dp_metadata.num_tokens_across_ep
