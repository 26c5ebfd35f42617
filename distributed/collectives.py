"""Asynchronous collectives over an optional group, portable across torch >= 2.6.

Each function issues ONE collective with ``async_op=True`` and returns ``(work, after)``: ``work``
to wait on (None when nothing was sent), and ``after`` (or None), a step to run once ``work`` has
completed (only the fallbacks need one). ``group=None`` means a single rank: the data is copied
locally. Newer ops are chosen at call time (``all_gather_single``/``reduce_scatter_single`` exist
only in newer torch); a backend that rejects an op at issue time gets a fallback built from older
ops. Every rank takes the same path, so the sequence of collectives stays identical across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed import Work

Pending = tuple["Work | None", "Callable[[], None] | None"]


def _is_unsupported(exc: BaseException) -> bool:
    message = str(exc).lower()
    return any(
        s in message for s in ("not support", "no support", "unsupported", "not implemented")
    )


def all_to_all_single(
    output: Tensor,
    input: Tensor,
    *,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: ProcessGroup | None,
) -> Pending:
    """Uneven all-to-all along dim 0 (``dist.all_to_all_single``); splits must match peers'."""
    if group is None:
        output.copy_(input)
        return None, None
    work = dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=True
    )
    return work, None


def all_gather_into(output: Tensor, input: Tensor, *, group: ProcessGroup | None) -> Pending:
    """``output [group_size * n, ...]`` = every rank's ``input [n, ...]`` stacked in rank order."""
    if group is None:
        output.copy_(input)
        return None, None
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        return gather(output, input, group=group, async_op=True), None
    except (RuntimeError, NotImplementedError) as exc:
        if not _is_unsupported(exc):
            raise
    # Fallback: list form (equal sizes here) writing straight into views of ``output``.
    world = dist.get_world_size(group)
    views = list(output.view(world, *input.shape).unbind(0))
    return dist.all_gather(views, input, group=group, async_op=True), None


def reduce_scatter_sum(output: Tensor, input: Tensor, *, group: ProcessGroup | None) -> Pending:
    """``output [n, ...]`` = sum over ranks of block ``rank`` of ``input [group_size * n, ...]``.

    ``input`` may be overwritten (the all_reduce fallback reduces in place).
    """
    if group is None:
        output.copy_(input)
        return None, None
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        return reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True), None
    except (RuntimeError, NotImplementedError) as exc:
        if not _is_unsupported(exc):
            raise
    # Fallback for backends without reduce_scatter: all_reduce everything, keep our block.
    rank, n = dist.get_rank(group), output.shape[0]
    work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work, lambda: output.copy_(input[rank * n : (rank + 1) * n])
