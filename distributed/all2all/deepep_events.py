"""Completion objects of the emulated DeepEP buffer: a ``Work``-shaped transfer that is also the
receive hook, and ``deep_ep.EventOverlap``'s shape on CPU (no streams: waiting blocks the host)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from distributed.collectives import Pending
from distributed.comm_handle import wait_work
from distributed.link_emulation import EmulatedLink, sleep_until


class EmulatedTransfer:
    """One in-flight collective of the emulated buffer, shaped like a ``torch.distributed.Work``
    (``wait(timeout)``, ``is_completed()``, ``get_future()``) and callable as DeepEP's recv hook.

    ``wait`` completes it once (thread-safe, idempotent): waits the collective (bounded by the
    buffer's timeout), then the emulated link's deadline, then runs ``finish`` (unpacking into
    the tensors the call returned). A failure is re-raised by every later ``wait``.
    """

    def __init__(
        self,
        *,
        op: str,
        rank: int,
        timeout: datetime.timedelta,
        pending: Pending,
        finish: Callable[[], None] | None,
        issued_at_ns: int,
        num_bytes: int,
        link: EmulatedLink | None,
        notify_ns: tuple[int, int] | None = None,
    ) -> None:
        self.op, self.rank, self.timeout = op, rank, timeout
        self._work, self._after = pending
        self._finish = finish
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self.issued_at_ns = issued_at_ns
        self.num_bytes = num_bytes
        self.notify_ns = notify_ns
        self.link_deadline_ns = None if link is None else link.deadline_ns(issued_at_ns, num_bytes)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Complete the receive; raises TimeoutError / RuntimeError as ``wait_work`` does."""
        limit = (timeout or self.timeout).total_seconds() + 5.0
        # blocking wait (timeout: the buffer's timeout + slack) for another thread's wait
        if not self._lock.acquire(timeout=limit):
            raise TimeoutError(f"{self.op} on rank {self.rank}: concurrent wait exceeded {limit} s")
        try:
            if not self._done:
                try:
                    # blocking wait (timeout: the buffer's timeout) on the collective
                    wait_work(self._work, op=self.op, rank=self.rank, timeout=self.timeout)
                    sleep_until(self.link_deadline_ns)  # blocking, bounded by the link model
                    if self._after is not None:
                        self._after()
                    if self._finish is not None:
                        self._finish()
                except BaseException as exc:
                    self._error = exc
                finally:
                    self._done = True
                    self._work = self._after = self._finish = None
            if self._error is not None:
                raise self._error
            return True
        finally:
            self._lock.release()

    def __call__(self) -> None:
        """DeepEP's recv hook: make sure the data has arrived (and is unpacked)."""
        self.wait()

    def is_completed(self) -> bool:
        if self._done:
            return True
        deadline = self.link_deadline_ns
        if deadline is not None and time.perf_counter_ns() < deadline:
            return False
        work = self._work
        return work is None or work.is_completed()

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
