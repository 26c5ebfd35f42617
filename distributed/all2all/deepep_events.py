"""Completion objects of the emulated DeepEP buffer: a ``Work``-shaped transfer that is also the
receive hook, and ``deep_ep.EventOverlap``'s shape on CPU (no streams: waiting blocks the host)."""

from __future__ import annotations

import datetime
from collections.abc import Callable

from distributed.collectives import Pending
from distributed.comm_handle import CollectiveHandle, CommTiming


class EmulatedTransfer(CollectiveHandle[bool]):
    """One in-flight collective of the emulated buffer: a ``CollectiveHandle`` (its completion
    logic: the collective's wait bounded by the buffer's timeout, then ``finish`` once,
    thread-safe, a failure re-raised by every later wait) that is also shaped like a
    ``torch.distributed.Work`` (``wait(timeout)`` returning True, ``is_completed()``,
    ``get_future()``) and callable as DeepEP's recv hook.

    ``finish`` unpacks into the tensors the Buffer call returned; ``pending``'s after-step (a
    fallback collective's) runs before it. ``timing``: the transfer at issue (``CommTiming``),
    which the backend's handle takes over.
    """

    __slots__ = ()

    def __init__(
        self,
        *,
        op: str,
        rank: int,
        timeout: datetime.timedelta,
        pending: Pending,
        finish: Callable[[], None] | None,
        timing: CommTiming,
    ) -> None:
        work, after = pending

        def finalize() -> bool:
            if after is not None:
                after()
            if finish is not None:
                finish()
            return True

        super().__init__(
            op=op, rank=rank, timeout=timeout, work=work, finalize=finalize, timing=timing
        )

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Complete the receive (``Work.wait``'s shape; the limit is the buffer's timeout).

        Raises:
            TimeoutError / RuntimeError: as ``CollectiveHandle.wait``.
        """
        return super().wait()

    def __call__(self) -> None:
        """DeepEP's recv hook: make sure the data has arrived (and is unpacked)."""
        self.wait()

    def get_future(self):
        work = self._work
        if work is None:
            raise NotImplementedError("no collective in flight")
        return work.get_future()


class EmulatedEventOverlap:
    """``deep_ep.EventOverlap``'s shape on CPU: ``current_stream_wait()`` blocks until the
    transfer behind it has completed (no transfer: returns at once). ``transfer`` is exposed so
    adapters can hand it to a ``CommHandle`` as its work."""

    def __init__(self, transfer: EmulatedTransfer | None = None) -> None:
        self.transfer = transfer

    def current_stream_wait(self) -> None:
        if self.transfer is not None:
            self.transfer.wait()

    def __enter__(self) -> EmulatedEventOverlap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()
