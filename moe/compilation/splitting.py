"""Splitting ops: the calls graph mode keeps out of its graphs (vLLM's ``splitting_ops``):
``splitting_op`` marks them in the model, ``recording_splitting_ops`` records them while tracing,
``run_splitting_op`` runs them on a bucket's real rows. Details: docs/hardware.md, "Splitting
ops"."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dbo.forward_context import (
    ForwardContext,
    current_forward_context,
    get_forward_context,
    set_forward_context,
)
from dbo.timeline.recorder import set_timeline_layer, timeline_layer, timeline_span

OP_NAME = "moe_dbo::splitting_op"


@torch.library.custom_op(OP_NAME, mutates_args=())
def _splitting_op(tensors: list[Tensor], index: int, out_shape: list[int]) -> Tensor:
    # Reached only by a real-mode trace (make_fx runs ops while it records them): the value is a
    # stand-in of the right shape; graph mode never calls the op itself at run time.
    if _recorded is None:
        raise RuntimeError(f"{OP_NAME} runs only while graph mode traces a forward")
    return tensors[0].new_zeros((tensors[0].shape[0], *out_shape))


@_splitting_op.register_fake
def _(tensors: list[Tensor], index: int, out_shape: list[int]) -> Tensor:
    return tensors[0].new_empty((tensors[0].shape[0], *out_shape))


@dataclass(frozen=True, slots=True)
class SplittingOp:
    """One recorded call: ``fn``, whether it takes the attention metadata, the decoder layer the
    timeline was in when it was traced (restored around each call) and its span name (None: no
    span, e.g. for a call that records its own compute and communication spans)."""

    fn: Callable[..., Tensor]
    takes_attn_metadata: bool
    timeline_layer: int | None
    span: str | None


_recorded: list[SplittingOp] | None = None  # set only while graph mode traces, at start-up
_captures_capturable = False  # while tracing: whether ``capturable`` calls go into the graph


def splitting_op(
    fn: Callable[..., Tensor],
    *tensors: Tensor,
    out_shape: Sequence[int],
    attn_metadata: Any = None,
    span: str | None = None,
    capturable: bool = False,
) -> Tensor:
    """``fn(*tensors)``, or ``fn(*tensors, attn_metadata)`` when ``attn_metadata`` is given; a
    point where graph mode splits the forward.

    Args:
        fn: the call to keep out of graphs; returns [num_tokens, *out_shape] in the dtype of
            ``tensors[0]``.
        tensors: row tensors, each [num_tokens, ...] (any dtype).
        out_shape: the trailing dims of ``fn``'s output.
        attn_metadata: this (u)batch's attention metadata, for an attention core.
        span: the timeline span graph mode records the call as (eagerly the caller's spans
            cover it).
        capturable: ``fn`` communicates nothing, yields nowhere and needs no attention metadata:
            a graph backend that captures such calls traces it into the graph.
    """
    if _recorded is None or (capturable and _captures_capturable):  # eager, or traced inline
        return fn(*tensors) if attn_metadata is None else fn(*tensors, attn_metadata)
    _recorded.append(SplittingOp(fn, attn_metadata is not None, timeline_layer(), span))
    return torch.ops.moe_dbo.splitting_op(list(tensors), len(_recorded) - 1, list(out_shape))


@contextmanager
def recording_splitting_ops(*, capture_capturable: bool = False) -> Iterator[list[SplittingOp]]:
    """Within: ``splitting_op`` records its calls (yielded list; node ``index`` = list index)
    instead of running them, except ``capturable`` ones when ``capture_capturable`` (traced
    inline). Not thread-safe: for graph-mode start-up only."""
    global _recorded, _captures_capturable
    if _recorded is not None:
        raise RuntimeError("graph mode is already tracing a forward")
    _recorded, _captures_capturable = [], capture_capturable
    try:
        yield _recorded
    finally:
        _recorded, _captures_capturable = None, False


@contextmanager
def graph_forward(num_rows: int, attn_metadata: Any) -> Iterator[None]:
    """Within: this thread's splitting ops run on the first ``num_rows`` rows of the bucket, with
    the attention metadata of the current forward context (one of ``attn_metadata`` is entered
    where none is current: a model called outside the runner); the layer ends with the block.

    Raises:
        ValueError: if the current forward context holds other attention metadata.
    """
    context = current_forward_context()
    if context is None:
        with set_forward_context(ForwardContext(attn_metadata=attn_metadata)) as context:
            context.graph_rows = num_rows
            yield
        return
    if context.attn_metadata is not attn_metadata:
        raise ValueError("graph mode runs on the attention metadata of its forward context")
    context.graph_rows = num_rows
    try:
        yield
    finally:
        context.graph_rows = context.layer = None


def pad_rows(x: Tensor, num_rows: int) -> Tensor:
    """``x`` [n, ...] zero-padded to [num_rows, ...] (``x`` itself when n == num_rows)."""
    n = x.shape[0]
    if n == num_rows:
        return x
    out = x.new_zeros((num_rows, *x.shape[1:]))
    out[:n] = x
    return out


def run_splitting_op(op: SplittingOp, *tensors: Tensor) -> Tensor:
    """Run a recorded op inside a compiled forward: tensors [bucket, ...] -> [bucket, *out_shape],
    ``op.fn`` seeing only the first ``graph_rows`` rows (``graph_forward``)."""
    context = get_forward_context()
    rows = [t[: context.graph_rows] for t in tensors]
    if op.takes_attn_metadata:
        rows.append(context.attn_metadata)
    set_timeline_layer(op.timeline_layer)
    if op.span is None:
        out = op.fn(*rows)
    else:
        with timeline_span(op.span):
            out = op.fn(*rows)
    return pad_rows(out, tensors[0].shape[0])
