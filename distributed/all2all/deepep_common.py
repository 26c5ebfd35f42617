"""What the two DeepEP backends share: building the ``deep_ep.Buffer`` (or our emulation of it)
and wrapping a Buffer call's completion in a ``CommHandle``. A mixin, not a base class: the two
backends deliver different activation formats, so each subclasses the base of its own format
(``StandardAll2AllBackend`` / ``BatchedAll2AllBackend``) and only this plumbing is shared."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, ClassVar

from torch.distributed import ProcessGroup

from distributed.all2all.deepep_kernels import DEEPEP_KERNELS, make_deepep_buffer
from distributed.comm_handle import CommHandle, CommTiming


def previous_event(buffer):
    """DeepEP's ``previous_event`` for a call issued now: an event captured on the current CUDA
    stream (the kernels' inputs are ready when it fires); None on the emulation (CPU ops ran)."""
    if getattr(buffer, "implementation", "") != DEEPEP_KERNELS:
        return None
    return buffer.capture()


class DeepEPBufferMixin:
    """Mixed into an ``All2AllBackend`` subclass (before it in the bases): ``self.buffer``, a
    ``deep_ep.Buffer``-shaped object, and the handle over its calls' completions."""

    # sizes of DeepEP's buffers (see ``deepep_kernels.make_deepep_buffer``)
    extra_options: ClassVar[tuple[str, ...]] = ("hidden_size", "num_max_dispatch_tokens_per_rank")
    buffer: Any
    implementation: str
    # from All2AllBackend: set by its __init__, and its _handle method
    ep_group: ProcessGroup | None
    ep_rank: int
    ep_size: int
    num_experts: int
    timeout: datetime.timedelta
    _handle: Callable[..., CommHandle]

    def _attach_buffer(
        self,
        buffer,
        *,
        low_latency_mode: bool,
        hidden_size: int,
        num_max_dispatch_tokens_per_rank: int,
    ) -> None:
        """Keep ``buffer`` (a ready Buffer-shaped object: tests), else build one with
        ``make_deepep_buffer`` for this backend's group, sizes and timeout, and name its
        implementation for the logs. Call after ``All2AllBackend.__init__``."""
        self.buffer = buffer or make_deepep_buffer(
            low_latency_mode=low_latency_mode,
            group=self.ep_group,
            rank=self.ep_rank,
            num_ranks=self.ep_size,
            timeout=self.timeout,
            hidden_size=hidden_size,
            num_experts=self.num_experts,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        )
        self.implementation = self.buffer.implementation

    def _deepep_handle(self, op, work, finalize, start_ns: int, async_op: bool) -> CommHandle:
        """A ``CommHandle`` over a Buffer call's completion (``deepep_kernels.completion_work``),
        with the emulated transfer's ``CommTiming`` (DeepEP's kernels report none: issued at
        ``start_ns``, bytes unknown, 0)."""
        timing = getattr(work, "timing", None) or CommTiming(issued_at_ns=start_ns, num_bytes=0)
        # All2AllBackend._handle: the one place a payload's handle is made (and waited if sync)
        return self._handle(
            op=op, pending=(work, None), finalize=finalize, timing=timing, async_op=async_op
        )
