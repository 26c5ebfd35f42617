"""The ``deep_ep.Buffer`` the two DeepEP patterns call, DeepEP's own (CUDA, ``deep_ep``
importable, an NCCL EP group) or ours (``deepep_emulation.TorchDistributedBuffer``), and their
shared base, which turns a Buffer call's event or hook into a ``CommHandle``."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import ClassVar

import torch
from torch.distributed import ProcessGroup

from distributed.all2all.base import DEEPEP_KERNELS, FusedMoEPrepareAndFinalize
from distributed.all2all.deepep_emulation import EmulatedTransfer, TorchDistributedBuffer
from distributed.comm_handle import CommHandle, CommTiming
from distributed.communicator import Communicator, process_group_of

# NVLink buffer of the high-throughput mode (vLLM's default VLLM_DEEPEP_BUFFER_SIZE_MB is 1024)
HIGH_THROUGHPUT_NVL_BYTES = 1 << 30
# DeepEP's own tests size the low-latency buffer for 128 tokens per rank
DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK = 128

__all__ = ["DEEPEP_KERNELS", "DeepEPPrepareAndFinalizeBase", "TorchDistributedBuffer"]


def deepep_kernels_available(group: ProcessGroup | Communicator | None) -> bool:
    """Whether DeepEP's own kernels can run: CUDA, ``deep_ep`` importable, an NCCL EP group."""
    group = process_group_of(group)
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
    group: ProcessGroup | Communicator | None,
    rank: int,
    num_ranks: int,
    timeout: datetime.timedelta,
    hidden_size: int,
    num_experts: int,
    num_max_dispatch_tokens_per_rank: int,
):
    """``deep_ep.Buffer`` where its kernels can run, else ``TorchDistributedBuffer``; the object's
    ``implementation`` names which. DeepEP's is sized as its documentation says: low latency by
    ``Buffer.get_low_latency_rdma_size_hint`` with a QP per local expert, high throughput 1 GiB."""
    if not deepep_kernels_available(group):
        return TorchDistributedBuffer(
            group,
            rank=rank,
            num_ranks=num_ranks,
            timeout=timeout,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        )
    import deep_ep

    group = process_group_of(group)  # DeepEP's Buffer takes the torch process group
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
    """``Work``-shaped wrapper of DeepEP's completion (an ``EventOverlap`` or a recv hook):
    ``wait()`` makes the current CUDA stream wait for the event, or runs the hook (which launches
    the receive kernel on the current stream); the host does not block, as with NCCL's
    ``Work.wait``. DeepEP's kernels bound their own waits (they trap on a timeout). No
    ``get_future``: the handle stamps the completion at ``wait()``."""

    def __init__(self, complete: Callable[[], None]) -> None:
        self._complete: Callable[[], None] | None = complete

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()
        return True

    def is_completed(self) -> bool:
        return self._complete is None


def completion_work(event_or_hook) -> EmulatedTransfer | DeviceCompletion | None:
    """What a ``CommHandle`` waits on for a Buffer call's ``event`` or ``hook``: our emulated
    transfer itself, or a ``DeviceCompletion``."""
    if event_or_hook is None or isinstance(event_or_hook, EmulatedTransfer):
        return event_or_hook
    return DeviceCompletion(getattr(event_or_hook, "current_stream_wait", event_or_hook))


class DeepEPPrepareAndFinalizeBase(FusedMoEPrepareAndFinalize):
    """What the two DeepEP patterns share: ``self.buffer`` and handles over its calls.

    Extra args (``extra_options``): ``hidden_size`` and ``num_max_dispatch_tokens_per_rank`` (the
    low-latency capacity C per rank) size DeepEP's buffer; ``buffer``: a ready Buffer-shaped object
    (tests), else ``make_deepep_buffer``.

    Raises:
        ValueError: ``num_max_dispatch_tokens_per_rank < 1`` (and the base class's checks).
    """

    extra_options = ("hidden_size", "num_max_dispatch_tokens_per_rank")
    low_latency_mode: ClassVar[bool]
    # ubatches DeepEP's own kernels allow in flight (None: any)
    kernels_max_num_ubatches: ClassVar[int | None] = None

    def __init__(
        self,
        *,
        hidden_size: int = 0,
        num_max_dispatch_tokens_per_rank: int = DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK,
        buffer=None,
        **kwargs,
    ) -> None:
        if num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank must be >= 1, got "
                f"{num_max_dispatch_tokens_per_rank}"
            )
        super().__init__(**kwargs)  # the groups, sizes and timeout
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.buffer = buffer or make_deepep_buffer(
            low_latency_mode=self.low_latency_mode,
            group=self.ep_group,
            rank=self.ep_rank,
            num_ranks=self.ep_size,
            timeout=self.timeout,
            hidden_size=hidden_size,
            num_experts=self.num_experts,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        )
        self.implementation = self.buffer.implementation
        if self.implementation == DEEPEP_KERNELS:
            self.max_num_ubatches = self.kernels_max_num_ubatches

    def with_link(self, link):
        """As the base class's, and the Buffer's notify behind ``link`` too (its own copy)."""
        linked = super().with_link(link)
        linked.buffer = self.buffer.with_link(link)
        return linked

    def previous_event(self):
        """DeepEP's ``previous_event`` for a call issued now: an event captured on the current
        CUDA stream (the kernels' inputs are ready when it fires); None on our emulation."""
        return self.buffer.capture() if self.implementation == DEEPEP_KERNELS else None

    def _buffer_handle(self, op: str, event_or_hook, finalize, start_ns: int) -> CommHandle:
        """The handle over a Buffer call's completion; its timing is our emulated transfer's, or
        (DeepEP's kernels report none) issued at ``start_ns`` with 0 bytes."""
        work = completion_work(event_or_hook)
        timing = getattr(work, "timing", None) or CommTiming(issued_at_ns=start_ns, num_bytes=0)
        return self._handle((work, None), finalize, op=op, timing=timing)
