"""One return shape for asynchronous communication: the ``CommHandle[T]`` protocol.

Two handles satisfy it: ``CollectiveHandle`` wraps the ``Work`` of one in-flight collective and a
``finalize`` step that turns the received buffer into the caller's value (unpacking rows,
scattering back to token order); ``CompletedHandle`` holds a value that needed no communication.
The handle, not the backend, owns everything that changes after issue, so a backend object holds
no per-call state and two ubatch threads can share it.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

from distributed.link_emulation import sleep_until

if TYPE_CHECKING:
    from torch.distributed import Work

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class CommHandle(Protocol[T_co]):
    """What callers of an asynchronous communication get back, whose result is a ``T_co``.

    Attributes:
        issued_at_ns: ``time.perf_counter_ns()`` when the communication was issued.
        completed_at_ns: ``perf_counter_ns()`` when the data had arrived; None until known.
        num_bytes: payload bytes this rank sends to other ranks (0: nothing was sent).
        notify_ns: ``(start, end)`` ``perf_counter_ns`` of a blocking count exchange run before
            the payload was issued (DeepEP's notify step), or None if there was none.
        finish_ns: ``(start, end)`` ``perf_counter_ns`` of the receive-side work that turned the
            arrived bytes into the value (unpacking rows, scattering them back, the weighted sum
            of a combine: compute, like DeepEP's receive kernels), once done; None before or
            when there was none.
    """

    @property
    def issued_at_ns(self) -> int: ...

    @property
    def completed_at_ns(self) -> int | None: ...

    @property
    def num_bytes(self) -> int: ...

    @property
    def notify_ns(self) -> tuple[int, int] | None: ...

    @property
    def finish_ns(self) -> tuple[int, int] | None: ...

    def is_completed(self) -> bool:
        """Whether the data has arrived (never blocks)."""
        ...

    def wait(self) -> T_co:
        """Block until the data has arrived; the result (idempotent: the same object each call)."""
        ...


class CompletedHandle(Generic[T]):
    """A ``CommHandle`` whose value is ready at construction (no communication: ``num_bytes`` 0,
    no notify step)."""

    __slots__ = ("_value", "issued_at_ns", "completed_at_ns", "num_bytes", "notify_ns", "finish_ns")

    def __init__(self, value: T):
        self._value = value
        self.issued_at_ns = time.perf_counter_ns()
        self.completed_at_ns: int | None = self.issued_at_ns
        self.num_bytes = 0
        self.notify_ns: tuple[int, int] | None = None
        self.finish_ns: tuple[int, int] | None = None

    def wait(self) -> T:
        return self._value

    def is_completed(self) -> bool:
        return True


def comm_error(op: str, rank: int, timeout: datetime.timedelta, exc: BaseException) -> Exception:
    """The exception to raise for a failed collective: TimeoutError for timeouts, else RuntimeError."""
    if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower():
        return TimeoutError(
            f"{op} on rank {rank} did not complete within {timeout.total_seconds():g} s "
            f"(a peer rank is stuck, dead or issued a different collective): {exc}"
        )
    return RuntimeError(f"{op} failed on rank {rank}: {exc}")


def wait_work(work: Work | None, *, op: str, rank: int, timeout: datetime.timedelta) -> None:
    """Block until ``work`` completes (None: nothing in flight).

    Raises:
        TimeoutError: if it does not complete within ``timeout``.
        RuntimeError: if the collective failed (e.g. a peer died).
    """
    if work is None:
        return
    try:
        # blocking wait (timeout: the group timeout) on one collective
        work.wait(timeout=timeout)
    except Exception as exc:
        if isinstance(exc, (TimeoutError, RuntimeError)) and str(exc).startswith(f"{op} "):
            raise  # already reported by a wait on the same operation (a wrapped completion)
        raise comm_error(op, rank, timeout, exc) from exc


class CollectiveHandle(Generic[T]):
    """The ``CommHandle`` of one asynchronous collective whose result is a ``T``.

    Attributes:
        issued_at_ns: ``time.perf_counter_ns()`` when the collective was issued.
        completed_at_ns: ``perf_counter_ns()`` when the data had arrived: stamped by a callback on
            the ``Work``'s future (real completion, from the communication thread), or at
            ``wait()`` when the backend offers no future. None until known.
        num_bytes: payload bytes this rank sends to other ranks in this collective.
        notify_ns: ``(start, end)`` ``perf_counter_ns`` of the blocking count exchange the backend
            ran before issuing the payload (DeepEP's notify step), or None if there was none.
        link_deadline_ns: with an emulated link (``distributed.link_emulation``), the earliest
            ``perf_counter_ns`` at which the collective may complete; ``wait()`` sleeps until then
            and ``completed_at_ns`` is never earlier. None: a real link only.
        finish_ns: ``(start, end)`` of the finalize step (from the start of the work's own
            finish step when the work is itself a handle that has one, e.g. the emulated DeepEP
            buffer's transfer), set by the first ``wait()``.

    ``wait()`` is idempotent and thread-safe: the first call blocks (with the group timeout) and
    runs the finalize step once; every later call, from any thread, returns the same object (or
    raises the same error).
    """

    __slots__ = (
        "_op",
        "_rank",
        "_timeout",
        "_work",
        "_finalize",
        "_lock",
        "_done",
        "_result",
        "_error",
        "_completed_at_ns",
        "issued_at_ns",
        "num_bytes",
        "notify_ns",
        "link_deadline_ns",
        "finish_ns",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        op: str,
        rank: int,
        timeout: datetime.timedelta,
        work: Work | None,
        finalize: Callable[[], T],
        issued_at_ns: int,
        num_bytes: int,
        notify_ns: tuple[int, int] | None = None,
        link_deadline_ns: int | None = None,
    ) -> None:
        self._op = op
        self._rank = rank
        self._timeout = timeout
        self._work = work
        self._finalize: Callable[[], T] | None = finalize
        self._lock = threading.Lock()
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._completed_at_ns: int | None = None
        self.issued_at_ns = issued_at_ns
        self.num_bytes = num_bytes
        self.notify_ns = notify_ns
        self.link_deadline_ns = link_deadline_ns
        self.finish_ns: tuple[int, int] | None = None
        if work is not None:
            self._stamp_on_completion(work)

    def _stamp_on_completion(self, work: Work) -> None:
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError, NotImplementedError):
            return  # no future for this backend/op: wait() stamps instead
        future.then(self._on_complete)

    def _on_complete(self, _future) -> None:
        # Runs on the communication thread; only stamps the time (never reads the value, which
        # would raise here if the collective failed; wait() reports failures).
        if self._completed_at_ns is None:
            self._completed_at_ns = time.perf_counter_ns()

    @property
    def completed_at_ns(self) -> int | None:
        stamp, deadline = self._completed_at_ns, self.link_deadline_ns
        if stamp is None or deadline is None:
            return stamp
        return max(stamp, deadline)

    def is_completed(self) -> bool:
        """Whether the data has arrived (does not run finalize, never blocks)."""
        if self._done:
            return True
        deadline = self.link_deadline_ns
        if deadline is not None and time.perf_counter_ns() < deadline:
            return False
        work = self._work
        return work is None or work.is_completed()

    def wait(self) -> T:
        """Block until the collective completes and return its value (same object every call).

        Raises:
            TimeoutError: if the collective (or another thread's wait on it) exceeds the timeout.
            RuntimeError: if the collective failed.
        """
        # blocking wait (timeout: group timeout + slack) for another thread already in wait()
        if not self._lock.acquire(timeout=self._timeout.total_seconds() + 5.0):
            raise TimeoutError(
                f"{self._op} on rank {self._rank}: another thread's wait() did not finish within "
                f"{self._timeout.total_seconds():g} s"
            )
        try:
            if not self._done:
                self._complete()
            if self._error is not None:
                raise self._error
            return self._result  # type: ignore[return-value]
        finally:
            self._lock.release()

    def _complete(self) -> None:
        try:
            wait_work(self._work, op=self._op, rank=self._rank, timeout=self._timeout)
            sleep_until(self.link_deadline_ns)  # blocking wait, bounded by the emulated deadline
            if self._completed_at_ns is None:  # no future: the work's own stamp, else now
                inner_done = getattr(self._work, "completed_at_ns", None)
                self._completed_at_ns = inner_done or time.perf_counter_ns()
            start_ns = time.perf_counter_ns()
            self._result = self._finalize()  # type: ignore[misc]
            inner = getattr(self._work, "finish_ns", None)  # a handle's own finish step
            self.finish_ns = (min(start_ns, inner[0]) if inner else start_ns,
                              time.perf_counter_ns())  # fmt: skip
        except BaseException as exc:
            self._error = exc
        finally:
            self._done = True
            self._work = None
            self._finalize = None  # drop the buffers it closes over
