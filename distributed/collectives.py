"""Asynchronous collectives over an optional group, portable across torch >= 2.6.

Each function issues ONE collective with ``async_op=True`` and returns ``(work, after)``: ``work``
to wait on (None when nothing was sent), and ``after`` (or None), a step to run once ``work`` has
completed (only the fallbacks need one). ``group=None`` means a single rank: the data is copied
locally. Newer ops are chosen at call time (``all_gather_single``/``reduce_scatter_single`` exist
only in newer torch); a backend that rejects an op at issue time gets a fallback built from older
ops. Every rank takes the same path, so the sequence of collectives stays identical across ranks.

Device tensors over a gloo group (ranks sharing one GPU: NCCL refuses two ranks per device) are
staged through host memory: the input is copied to the host (a host-device sync, on the caller's
current stream: a ubatch's comm stream under DBO), the collective runs on host tensors, and the
after-step copies the result back onto the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
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


def _host_staged(collective: Callable[..., Pending]) -> Callable[..., Pending]:
    """``collective(output, input, *, group, ...)`` staged through host memory where ``group``
    is a gloo group and the tensors live on an accelerator (see the module docstring)."""

    @functools.wraps(collective)
    def run(output: Tensor, input: Tensor, *, group: ProcessGroup | None, **kwargs) -> Pending:
        if group is None or output.is_cpu or dist.get_backend(group) != "gloo":
            return collective(output, input, group=group, **kwargs)
        host_output = torch.empty(output.shape, dtype=output.dtype)
        host_input = input.cpu()  # host-device sync: the bytes must be on the host for gloo
        work, after = collective(host_output, host_input, group=group, **kwargs)

        def land() -> None:
            if after is not None:
                after()
            output.copy_(host_output)  # host-to-device, on the caller's current stream

        return work, land

    return run


@_host_staged
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


@_host_staged
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


@_host_staged
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
