"""The collectives of one process group, as an object: ``Communicator`` (torch.distributed: gloo
or NCCL; each op returns ``Pending`` = ``(work, after)``); ``ShmCommunicator`` is its same-host
subclass (``distributed.shm_transport``). Fallbacks and host staging: docs/backends.md,
"Communicator"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed import Work

Pending = tuple["Work | None", "Callable[[], None] | None"]

# the memory host transports (gloo, shared memory) read; device tensors are staged through it.
# A device object, not a platform question: distributed sits below moe.platforms
HOST_DEVICE = torch.device("cpu")

__all__ = ["Communicator", "Pending", "as_communicator", "process_group_of"]


def _is_unsupported(exc: BaseException) -> bool:
    message = str(exc).lower()
    return any(
        s in message for s in ("not support", "no support", "unsupported", "not implemented")
    )


class Communicator:
    """The collectives of ``group`` through torch.distributed (its own backend: gloo or NCCL).

    Attributes:
        group: the process group. rank, size: this rank in it and its size.
        backend: what moves the bytes, for logs: ``"gloo"``, ``"nccl"`` (``"shm+gloo"`` for the
            same-host subclass).
        is_host_transport: whether the transport reads host memory (device tensors are staged).
    """

    @property
    def tensor_device(self) -> torch.device:
        """Where tensors built for this transport live: the host, or this rank's current CUDA
        device for NCCL (which takes nothing else)."""
        if self.is_host_transport:
            return HOST_DEVICE
        return torch.device("cuda", torch.cuda.current_device())

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.backend = dist.get_backend(group)
        self.is_host_transport = self.backend != "nccl"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}/{self.size})"

    def close(self) -> None:
        """Release what the transport holds beyond the process group (nothing here)."""

    # -- the public ops: stage device tensors, then the transport's own op -------------------

    def all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        *,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
    ) -> Pending:
        """Uneven all-to-all along dim 0 (``dist.all_to_all_single``); splits must match peers'
        (None: ``shape[0] / size`` rows each)."""
        return self._staged(
            lambda o, i: self._all_to_all_single(o, i, output_split_sizes, input_split_sizes),
            output,
            input,
        )

    def all_gather_into(self, output: Tensor, input: Tensor) -> Pending:
        """``output [size * n, ...]`` = every rank's ``input [n, ...]`` stacked in rank order."""
        return self._staged(self._all_gather_into, output, input)

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """``output [n, ...]`` = sum over ranks of block ``rank`` of ``input [size * n, ...]``.
        ``input`` may be overwritten (the all_reduce fallback reduces in place)."""
        return self._staged(self._reduce_scatter_sum, output, input)

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """``tensor`` = the elementwise sum over ranks of ``tensor``, in place."""
        return self._staged(lambda o, i: self._all_reduce_sum(o), tensor, tensor)

    def _staged(self, op: Callable[[Tensor, Tensor], Pending], output: Tensor, input: Tensor):
        if not self.is_host_transport or output.device == HOST_DEVICE:
            return op(output, input)
        host_output = torch.empty(output.shape, dtype=output.dtype, device=HOST_DEVICE)
        # host-device sync: the bytes must be on the host for a host transport
        host_input = host_output if input is output else input.cpu()
        if input is output:
            host_output.copy_(input)
        work, after = op(host_output, host_input)

        def land() -> None:
            if after is not None:
                after()
            output.copy_(host_output)  # host-to-device, on the caller's current stream

        return work, land

    # -- torch.distributed's ops (host or device tensors as the backend takes them) ----------

    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes) -> Pending:
        work = dist.all_to_all_single(
            output,
            input,
            None if output_split_sizes is None else list(output_split_sizes),
            None if input_split_sizes is None else list(input_split_sizes),
            group=self.group,
            async_op=True,
        )
        return work, None

    def _all_gather_into(self, output: Tensor, input: Tensor) -> Pending:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            return gather(output, input, group=self.group, async_op=True), None
        except (RuntimeError, NotImplementedError) as exc:
            if not _is_unsupported(exc):
                raise
        # Fallback: list form (equal sizes here) writing straight into views of ``output``.
        views = list(output.view(self.size, *input.shape).unbind(0))
        return dist.all_gather(views, input, group=self.group, async_op=True), None

    def _reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            work = reduce_scatter(
                output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
            return work, None
        except (RuntimeError, NotImplementedError) as exc:
            if not _is_unsupported(exc):
                raise
        # Fallback for backends without reduce_scatter: all_reduce everything, keep our block.
        n = output.shape[0]
        work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return work, lambda: output.copy_(input[self.rank * n : (self.rank + 1) * n])

    def _all_reduce_sum(self, tensor: Tensor) -> Pending:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True), None


def as_communicator(group: ProcessGroup | Communicator | None) -> Communicator | None:
    """``group`` itself if it is a ``Communicator``, else a torch.distributed one over it (None
    stays None: a single rank)."""
    if group is None or isinstance(group, Communicator):
        return group
    return Communicator(group)


def process_group_of(group: ProcessGroup | Communicator | None) -> ProcessGroup | None:
    """The torch process group behind ``group`` (None stays None)."""
    return group.group if isinstance(group, Communicator) else group
