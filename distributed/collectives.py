"""Asynchronous collectives over an optional group: one function per op, whatever moves the bytes.

Each function issues ONE collective and returns ``(work, after)`` (``Pending``): ``work`` to wait
on (None when nothing was sent), and ``after`` (or None), a step to run once ``work`` has
completed. ``group`` is a ``Communicator`` (``distributed.communicator``: torch.distributed, or
shared memory between ranks of one node, ``distributed.shm_transport``), a torch process group
(its torch.distributed communicator) or None, a single rank: the data is copied locally.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.communicator import Communicator, Pending, as_communicator

__all__ = [
    "Pending",
    "all_gather_into",
    "all_reduce_sum",
    "all_to_all_single",
    "reduce_scatter_sum",
]

Group = ProcessGroup | Communicator | None


def all_to_all_single(
    output: Tensor,
    input: Tensor,
    *,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    group: Group,
) -> Pending:
    """Uneven all-to-all along dim 0 (``dist.all_to_all_single``); splits must match peers'."""
    comm = as_communicator(group)
    if comm is None:
        output.copy_(input)
        return None, None
    return comm.all_to_all_single(
        output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes
    )


def all_gather_into(output: Tensor, input: Tensor, *, group: Group) -> Pending:
    """``output [group_size * n, ...]`` = every rank's ``input [n, ...]`` stacked in rank order."""
    comm = as_communicator(group)
    if comm is None:
        output.copy_(input)
        return None, None
    return comm.all_gather_into(output, input)


def reduce_scatter_sum(output: Tensor, input: Tensor, *, group: Group) -> Pending:
    """``output [n, ...]`` = sum over ranks of block ``rank`` of ``input [group_size * n, ...]``.

    ``input`` may be overwritten (the all_reduce fallback reduces in place).
    """
    comm = as_communicator(group)
    if comm is None:
        output.copy_(input)
        return None, None
    return comm.reduce_scatter_sum(output, input)


def all_reduce_sum(tensor: Tensor, *, group: Group) -> Pending:
    """``tensor`` = the elementwise sum of every rank's ``tensor``, in place."""
    comm = as_communicator(group)
    if comm is None:
        return None, None
    return comm.all_reduce_sum(tensor)
