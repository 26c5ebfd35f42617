"""Ranks of one node exchange through shared memory; ranks on other nodes through the group's own
backend (gloo), point to point: ``ShmCommunicator``, made by ``create_communicator``.

After vLLM's CPU backend (``csrc/cpu/shm.cpp``) and NCCL's shm transport between the ranks of a
node. The hot loop (copy, flag, poll, the vectorised sum) is the C++ ``ShmComm`` of our CPU
kernels (``moe/kernels/csrc/shm_comm.cpp``), handed in by the platform (this package does not
build kernels): per channel one slot per local rank in one segment, a worker thread running the
channel's operations in issue order, so issuing returns at once and ``wait()`` blocks, as on a
gloo ``Work``; a caller that waits for an operation the worker has not started runs it itself
(no thread hand-off), and the worker runs one nobody waits for within 100 µs of its issue. Operation ``i`` of a communicator runs on channel ``i % num_channels``: every rank
issues the same operations in the same order (the contract of every collective), so the two DBO
ubatches' transfers ride two channels and one never queues behind the other. Waits spin for a
few microseconds, then sleep on a futex that the peer's flag store wakes (no core is burnt).

A node is what torchrun says (``GROUP_RANK``), not the hostname. Sums add the ranks' values in
rank order (half types in float32, rounded once), so every rank gets the same bits.

Failure model (as gloo's): every wait is bounded by the group timeout, and a timeout names the
rank that did not join; a local peer that exits is noticed within 20 ms (its pid is polled while
waiting); the first failure poisons the segment, so every local rank raises, naming the rank that
failed first. The segment is unlinked as soon as every local rank has mapped it (after a
rendezvous over the group), so nothing is left in ``/dev/shm`` even after SIGKILL; names carry the
job id (torchrun's run id and master port), the group and a random nonce, so jobs never collide.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.communicator import Communicator, Pending

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_NUM_CHANNELS",
    "SUM_DTYPES",
    "ShmCommunicator",
    "create_communicator",
]

logger = logging.getLogger(__name__)

DEFAULT_NUM_CHANNELS = 2  # one per DBO ubatch in flight
DEFAULT_CAPACITY_BYTES = 2 << 20  # per local rank and channel; larger messages take rounds
MAX_LOCAL_RANKS = 16  # the C++ slot header's limit
# dtypes the C++ sum adds (others fall back to the group's backend, on every rank alike)
SUM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)
_COPY, _SUM = 1, 2


@dataclass(frozen=True, slots=True, kw_only=True)
class _RankInfo:
    node: int
    pid: int
    has_kernels: bool


class _ShmWork:
    """``Work``-shaped: one shared-memory operation and the point-to-point works to remote ranks.
    ``wait(timeout)`` raises ``TimeoutError`` (naming the rank that did not join) or
    ``RuntimeError``; no ``get_future`` (the handle stamps completion at ``wait()``)."""

    __slots__ = ("_native", "_p2p", "_timeout_s")

    def __init__(self, native, p2p: list, timeout_s: float) -> None:
        self._native = native
        self._p2p = p2p
        self._timeout_s = timeout_s

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        if self._native is not None:
            error = self._native.wait(seconds)  # blocking wait (timeout), GIL released
            if error:
                raise (TimeoutError if error.startswith("timed out") else RuntimeError)(error)
        for work in self._p2p:
            work.wait(timeout) if timeout is not None else work.wait()  # blocking (timeout)
        return True

    def is_completed(self) -> bool:
        native_done = self._native is None or self._native.is_completed()
        return native_done and all(work.is_completed() for work in self._p2p)


def _bytes(tensor: Tensor) -> Tensor:
    """A contiguous tensor's bytes, ``[nbytes]`` uint8 (a view)."""
    return tensor.reshape(-1).view(torch.uint8)


class ShmCommunicator(Communicator):
    """``Communicator`` whose ranks on this node exchange through shared memory (``native``, a
    C++ ``ShmComm`` over ``local_ranks``, group ranks in order) and whose other ranks exchange
    point to point over ``group`` (gloo). Made by ``create_communicator``; thread-safe."""

    def __init__(
        self,
        group: ProcessGroup,
        *,
        native,  # None: no other rank of the group on this node
        local_ranks: Sequence[int],
        num_channels: int,
        timeout: datetime.timedelta,
    ) -> None:
        super().__init__(group)
        self._native = native
        self._local_ranks = tuple(local_ranks)
        self._remote_ranks = tuple(r for r in range(self.size) if r not in self._local_ranks)
        self._global_ranks = tuple(dist.get_global_rank(group, r) for r in range(self.size))
        self.backend = "shm+gloo" if self._remote_ranks else "shm"
        self.is_host_transport = True
        self._num_channels = num_channels
        self._timeout_s = timeout.total_seconds()
        self._lock = threading.Lock()
        self._num_issued = 0
        # at close(), collection or exit: stop the channel threads, unmap the segment
        self._close = weakref.finalize(self, native.close) if native is not None else None

    def close(self) -> None:
        """Stop the channels' threads and unmap the segment (idempotent); later ops fail."""
        if self._close is not None:
            self._close()

    # -- one exchange: byte ranges per peer ---------------------------------------------------

    def _issue(
        self,
        kind: int,
        output: Tensor,
        input: Tensor,
        send: Sequence[tuple[int, int]],
        recv: Sequence[tuple[int, int]],
    ) -> _ShmWork:
        """Queue one exchange: rank ``r`` gets bytes ``send[r] = (offset, length)`` of ``input``
        and this rank's bytes from ``r`` land at ``recv[r]`` of ``output`` (``_SUM``: every
        local rank's block is summed into ``recv[rank]``); remote ranks' bytes move now over
        point-to-point gloo (copies only: ``_sum_mixed`` gathers first)."""
        with self._lock:
            channel = self._num_issued % self._num_channels
            self._num_issued += 1
        local = self._local_ranks
        if self._native is None:  # no local peer: this rank's own block is a local copy
            (send_at, length), (recv_at, _) = send[self.rank], recv[self.rank]
            _bytes(output)[recv_at : recv_at + length] = _bytes(input)[send_at : send_at + length]
            native = None
        else:
            native = self._native.issue(
                channel,
                kind,
                output,
                input,
                [send[r][0] for r in local],
                [send[r][1] for r in local],
                [recv[r][0] for r in local],
                [recv[r][1] for r in local],
                self._timeout_s,
            )
        p2p = []
        if self._remote_ranks:
            in_bytes, out_bytes = _bytes(input), _bytes(output)
            for r in self._remote_ranks:  # the same order on every rank: gloo matches in order
                (send_at, send_len), (recv_at, recv_len) = send[r], recv[r]
                peer = self._global_ranks[r]
                if send_len:
                    chunk = in_bytes[send_at : send_at + send_len]
                    p2p.append(dist.isend(chunk, dst=peer, group=self.group, tag=channel))
                if recv_len:
                    chunk = out_bytes[recv_at : recv_at + recv_len]
                    p2p.append(dist.irecv(chunk, src=peer, group=self.group, tag=channel))
        return _ShmWork(native, p2p, self._timeout_s)

    def _exchange(self, kind, output, input, send, recv) -> Pending:
        """``_issue`` on contiguous tensors: a non-contiguous output gets a contiguous stand-in
        copied back after completion."""
        input = input.contiguous()
        if output.is_contiguous():
            return self._issue(kind, output, input, send, recv), None
        landing = torch.empty(output.shape, dtype=output.dtype)
        return self._issue(kind, landing, input, send, recv), lambda: output.copy_(landing)

    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes) -> Pending:
        send = _ranges(input, input_split_sizes, self.size)
        recv = _ranges(output, output_split_sizes, self.size)
        return self._exchange(_COPY, output, input, send, recv)

    def _all_gather_into(self, output: Tensor, input: Tensor) -> Pending:
        n = input.numel() * input.element_size()
        send, recv = [(0, n)] * self.size, [(r * n, n) for r in range(self.size)]
        return self._exchange(_COPY, output, input, send, recv)

    def _reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        if input.dtype not in SUM_DTYPES:
            return super()._reduce_scatter_sum(output, input)
        n = output.numel() * output.element_size()
        send = [(r * n, n) for r in range(self.size)]
        return self._sum(output, input, send, n)

    def _all_reduce_sum(self, tensor: Tensor) -> Pending:
        if tensor.dtype not in SUM_DTYPES:
            return super()._all_reduce_sum(tensor)
        n = tensor.numel() * tensor.element_size()
        return self._sum(tensor, tensor, [(0, n)] * self.size, n)

    def _sum(self, output: Tensor, input: Tensor, send, n: int) -> Pending:
        """``output`` = the sum over ranks of their block ``send[rank]`` (``n`` bytes each)."""
        if not self._remote_ranks:
            return self._exchange(_SUM, output, input, send, [(0, n)] * self.size)
        # Across nodes: gather every rank's block, then add them in rank order on every rank.
        stage = torch.empty((self.size, output.numel()), dtype=output.dtype)
        work, _ = self._exchange(_COPY, stage, input, send, [(r * n, n) for r in range(self.size)])

        def add() -> None:
            accumulate = torch.float32 if output.dtype in (torch.bfloat16, torch.float16) else None
            total = stage[0].to(accumulate) if accumulate else stage[0].clone()
            for r in range(1, self.size):
                total += stage[r]
            output.copy_(total.view(output.shape))

        return work, add


def _ranges(tensor: Tensor, split_sizes: Sequence[int] | None, size: int) -> list[tuple[int, int]]:
    """Byte ``(offset, length)`` per rank of ``tensor`` cut along dim 0 by ``split_sizes`` rows
    (None: evenly)."""
    num_rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = (tensor.numel() // num_rows if num_rows else 0) * tensor.element_size()
    if num_rows == 0:
        row_bytes = int(torch.Size(tensor.shape[1:]).numel()) * tensor.element_size()
    splits = [num_rows // size] * size if split_sizes is None else list(split_sizes)
    ranges, at = [], 0
    for rows in splits:
        ranges.append((at * row_bytes, rows * row_bytes))
        at += rows
    return ranges


def create_communicator(
    group: ProcessGroup,
    *,
    kernels: ModuleType | None,
    node_rank: int,
    job_id: str,
    timeout: datetime.timedelta,
    num_channels: int = DEFAULT_NUM_CHANNELS,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
) -> Communicator:
    """The communicator of ``group``: shared memory between its ranks on one node, the group's
    backend between nodes; a plain ``Communicator`` when no node holds two of its ranks, or
    when any rank lacks ``kernels`` (the C++ CPU kernels: None where they did not build, or the
    transport is turned off), logged once.

    Collective over ``group`` (three object all-gathers, bounded by the group timeout): every
    rank calls it with the same ``num_channels`` and ``capacity_bytes``.

    Args:
        kernels: the module with ``ShmComm`` (``moe.kernels.cpu_kernels``), or None.
        node_rank: this rank's node (torchrun's ``GROUP_RANK``).
        job_id: names the segment (torchrun's run id and master port), with the group's name
            and a random nonce.

    Raises:
        ValueError: ``num_channels < 1`` or ``capacity_bytes < 4096``.
        RuntimeError: the segment could not be created or mapped on some rank (every rank).
    """
    if num_channels < 1 or capacity_bytes < 4096:
        raise ValueError(
            f"need num_channels >= 1 and capacity_bytes >= 4096, got {num_channels}, "
            f"{capacity_bytes}"
        )
    infos = _rank_infos(group, kernels, node_rank)
    if infos is None:
        return Communicator(group)
    local_ranks = [r for r, info in enumerate(infos) if info.node == node_rank]
    pids = [infos[r].pid for r in local_ranks]
    index = local_ranks.index(group.rank())
    layout = (len(local_ranks), index, num_channels, capacity_bytes, local_ranks, pids)
    native = _map_segment(group, kernels, job_id, node_rank, local_ranks, layout)
    return ShmCommunicator(  # native None: alone on this node, every peer is remote
        group,
        native=native,
        local_ranks=local_ranks,
        num_channels=num_channels,
        timeout=timeout,
    )


def _rank_infos(
    group: ProcessGroup, kernels: ModuleType | None, node_rank: int
) -> list[_RankInfo] | None:
    """Every rank's node, pid and whether it has the kernels; None where shared memory is off
    (no node holds two ranks, or some rank lacks the kernels: logged once). Collective over
    ``group`` (one object all-gather, bounded by the group timeout).

    Raises:
        ValueError: a node holds more than ``MAX_LOCAL_RANKS`` ranks.
    """
    mine = _RankInfo(node=node_rank, pid=os.getpid(), has_kernels=kernels is not None)
    infos: list[_RankInfo] = [mine] * group.size()
    dist.all_gather_object(infos, mine, group=group)  # blocking (group timeout)
    largest_node = max(sum(i.node == info.node for i in infos) for info in infos)
    if not all(info.has_kernels for info in infos) or largest_node < 2:
        if group.rank() == 0 and largest_node >= 2:
            logger.warning(
                "moe-dbo: shared-memory transport off (the C++ CPU kernels are not built or "
                "turned off on some rank): collectives run over %s",
                dist.get_backend(group),
            )
        return None
    if largest_node > MAX_LOCAL_RANKS:
        raise ValueError(
            f"at most {MAX_LOCAL_RANKS} ranks per node share memory, got {largest_node}"
        )
    return infos


def _map_segment(
    group: ProcessGroup,
    kernels: ModuleType,
    job_id: str,
    node_rank: int,
    local_ranks: list[int],
    layout: tuple,
):
    """This rank's ``kernels.ShmComm`` over its node's segment, or None when it is alone on its
    node. The node's first rank creates the segment, the others map it after; once every local
    rank has mapped it, each unlinks its name (ENOENT is fine), so nothing stays in /dev/shm,
    even after SIGKILL. Collective over ``group`` (two object all-gathers, bounded by the group
    timeout).

    Raises:
        RuntimeError: the segment could not be created or mapped on some rank (every rank).
    """
    native, name, error = None, None, None
    index = layout[1]
    if index == 0 and len(local_ranks) > 1:  # the node's leader creates the segment
        name = _segment_name(job_id, group, node_rank)
        try:
            native = kernels.ShmComm(name, True, *layout)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"rank {group.rank()}: {exc}"
    names: list = [None] * group.size()
    dist.all_gather_object(names, (name, error), group=group)  # blocking (group timeout)
    leader_name, error = names[local_ranks[0]]
    if len(local_ranks) > 1 and index > 0 and error is None:
        try:
            native = kernels.ShmComm(leader_name, False, *layout)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"rank {group.rank()}: {exc}"
    errors: list = [None] * group.size()
    dist.all_gather_object(errors, error, group=group)  # blocking: every local rank has mapped it
    if leader_name is not None and len(local_ranks) > 1:
        # every local rank: the name is gone when create returns anywhere
        kernels.ShmComm.unlink(leader_name)
    failures = [e for e in errors if e is not None]
    if failures:
        if native is not None:
            native.close()
        raise RuntimeError(f"shared-memory transport could not start: {'; '.join(failures)}")
    return native


def _segment_name(job_id: str, group: ProcessGroup, node_rank: int) -> str:
    """``/moe_dbo_<job>_<group>_n<node>_<nonce>``, in the characters shm_open takes."""
    raw = f"moe_dbo_{job_id}_{getattr(group, 'group_name', '')}_n{node_rank}_{os.urandom(4).hex()}"
    return "/" + re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:200]
