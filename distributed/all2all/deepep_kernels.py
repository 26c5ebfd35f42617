"""Which ``deep_ep.Buffer`` runs: DeepEP's own kernels (CUDA, ``deep_ep`` importable, an NCCL EP
group) or our torch.distributed emulation (``deepep_buffer.TorchDistributedBuffer``), and the
``Work``-shaped completion a ``CommHandle`` waits on for either."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from distributed.all2all.deepep_buffer import TorchDistributedBuffer
from distributed.all2all.deepep_events import EmulatedEventOverlap, EmulatedTransfer

DEEPEP_KERNELS = "deep_ep kernels"
# NVLink buffer of the high-throughput mode (vLLM's default VLLM_DEEPEP_BUFFER_SIZE_MB is 1024)
HIGH_THROUGHPUT_NVL_BYTES = 1 << 30


def deepep_kernels_available(group: ProcessGroup | None) -> bool:
    """Whether DeepEP's own kernels can run: CUDA, ``deep_ep`` importable, an NCCL EP group."""
    if group is None or not torch.cuda.is_available():
        return False
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    import torch.distributed as dist

    return dist.get_backend(group) == "nccl"


def make_deepep_buffer(
    *,
    low_latency_mode: bool,
    group: ProcessGroup | None,
    rank: int,
    num_ranks: int,
    timeout: datetime.timedelta,
    hidden_size: int,
    num_experts: int,
    num_max_dispatch_tokens_per_rank: int,
):
    """``deep_ep.Buffer`` where DeepEP's kernels can run (see ``deepep_kernels_available``), else
    ``TorchDistributedBuffer``; the object's ``implementation`` names which (for the logs).

    DeepEP's buffer is sized as its documentation says: low latency with
    ``Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
    num_experts)`` and one QP per local expert; high throughput with an NVLink buffer of 1 GiB.
    """
    if not deepep_kernels_available(group):
        return TorchDistributedBuffer(
            group,
            rank=rank,
            num_ranks=num_ranks,
            timeout=timeout,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        )
    import deep_ep

    if low_latency_mode:
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden_size, num_ranks, num_experts
        )
        buffer = deep_ep.Buffer(
            group,
            num_nvl_bytes=0,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=num_experts // num_ranks,
        )
    else:
        buffer = deep_ep.Buffer(group, num_nvl_bytes=HIGH_THROUGHPUT_NVL_BYTES, num_rdma_bytes=0)
    buffer.implementation = DEEPEP_KERNELS
    return buffer


class DeviceCompletion:
    """``Work``-shaped wrapper of DeepEP's completion (an ``EventOverlap`` or a recv hook) for a
    ``CommHandle``: ``wait()`` makes the current CUDA stream wait for the event, or runs the hook
    (which launches the receive kernel on the current stream); the host does not block, as with
    NCCL's ``Work.wait``. DeepEP's kernels bound their own waits (they trap on a timeout)."""

    def __init__(self, complete: Callable[[], None]) -> None:
        self._complete: Callable[[], None] | None = complete

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()
        return True

    def is_completed(self) -> bool:
        return self._complete is None

    def get_future(self):
        raise NotImplementedError("DeepEP events have no future")


def completion_work(event_or_hook) -> EmulatedTransfer | DeviceCompletion | None:
    """The object a ``CommHandle`` waits on for a Buffer call's ``event`` (``EventOverlap``-shaped)
    or ``hook`` (callable): the emulated transfer itself, or a ``DeviceCompletion``."""
    if event_or_hook is None:
        return None
    if isinstance(event_or_hook, EmulatedTransfer):
        return event_or_hook
    if isinstance(event_or_hook, EmulatedEventOverlap):
        return event_or_hook.transfer
    if hasattr(event_or_hook, "current_stream_wait"):
        return DeviceCompletion(event_or_hook.current_stream_wait)
    return DeviceCompletion(event_or_hook)
