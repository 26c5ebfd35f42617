"""One return shape for asynchronous communication: the ``CommHandle[T]`` protocol.

A handle answers three things: ``wait()`` (the value), ``is_completed()`` and ``timing``, one
``CommTiming`` record of when the communication ran and what it carried. Two handles satisfy it:
``CollectiveHandle`` wraps the ``Work`` of one in-flight collective and a ``finalize`` step that
turns the received buffer into the caller's value (unpacking rows, scattering back to token
order); ``CompletedHandle`` holds a value that needed no communication. The handle, not the
backend, owns everything that changes after issue, so a backend object holds no per-call state
and two ubatch threads can share it.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from torch.distributed import Work

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommTiming:
    """When one communication ran and what it carried (a handle's telemetry, one record).

    Times are ``time.perf_counter_ns()`` stamps (ns, this process's monotonic clock); sizes are
    bytes of payload between this rank and OTHER ranks (a rank's own rows stay in memory).

    Attributes:
        issued_at_ns: when the payload was issued.
        num_bytes: bytes this rank sends to other ranks (0: nothing was sent).
        num_recv_bytes: bytes this rank receives from other ranks, when the backend knows it at
            issue; None: not reported (a link model then bills ``num_bytes`` both ways).
        notify_ns: ``(start, end)`` of a blocking count exchange run before the payload was
            issued (DeepEP's notify step), or None if there was none.
        completed_at_ns: when the data had arrived; None until known.
        payload_at_ns: when the payload itself had arrived, where an emulated link
            (``link_emulation.LinkDelayedHandle``) then held it back to its deadline: the
            exchange without the link, which the planner's calibration reads; None: at
            ``completed_at_ns``.
        finish_ns: ``(start, end)`` of the receive-side work that turned the arrived bytes into
            the value (unpacking rows, scattering them back, the weighted sum of a combine:
            compute, like DeepEP's receive kernels), once done; None before, or when there was
            none.
    """

    issued_at_ns: int
    num_bytes: int
    num_recv_bytes: int | None = None
    notify_ns: tuple[int, int] | None = None
    completed_at_ns: int | None = None
    finish_ns: tuple[int, int] | None = None
    payload_at_ns: int | None = None

    def __post_init__(self) -> None:
        if self.num_bytes < 0 or (self.num_recv_bytes or 0) < 0:
            raise ValueError(
                f"num_bytes ({self.num_bytes}) and num_recv_bytes ({self.num_recv_bytes}) must "
                f"be >= 0"
            )

    @property
    def num_link_bytes(self) -> int:
        """Bytes a full-duplex link carries for it: the larger direction."""
        return max(self.num_bytes, self.num_recv_bytes or 0)

    def at_issue(self) -> CommTiming:
        """This record without what is stamped after issue (completion, finish): itself when it
        has none (the usual case: no copy in the hot path)."""
        if self.completed_at_ns is None and self.finish_ns is None and self.payload_at_ns is None:
            return self
        return dataclasses.replace(self, completed_at_ns=None, finish_ns=None, payload_at_ns=None)


@runtime_checkable
class CommHandle(Protocol[T_co]):
    """What callers of an asynchronous communication get back, whose result is a ``T_co``.

    ``timing`` is the record as known now: its completion and finish fields fill in (a new
    record each time; a record never changes) once the data has arrived and been unpacked.
    """

    @property
    def timing(self) -> CommTiming: ...

    def is_completed(self) -> bool:
        """Whether the data has arrived (never blocks)."""
        ...

    def wait(self) -> T_co:
        """Block until the data has arrived; the result (idempotent: the same object each call)."""
        ...


class CompletedHandle(Generic[T]):
    """A ``CommHandle`` whose value is ready at construction (no communication: 0 bytes, no
    notify step, completed at issue)."""

    __slots__ = ("_value", "timing")

    def __init__(self, value: T):
        self._value = value
        now_ns = time.perf_counter_ns()
        self.timing = CommTiming(issued_at_ns=now_ns, num_bytes=0, completed_at_ns=now_ns)

    def wait(self) -> T:
        return self._value

    def is_completed(self) -> bool:
        return True


def comm_error(op: str, rank: int, timeout: datetime.timedelta, exc: BaseException) -> Exception:
    """The exception to raise for a failed collective: TimeoutError for timeouts, else
    RuntimeError."""
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

    Args:
        op, rank: name the collective in errors. timeout: limit of the blocking wait.
        work: the collective's ``Work`` (None: nothing in flight), or a handle used as one (the
            emulated DeepEP transfer), whose own completion and finish stamps are then used.
        finalize: turns the received buffers into the value; run once, by the first ``wait()``.
        timing: the record at issue (issue time, bytes, notify span).

    ``timing.completed_at_ns`` is stamped by a callback on the ``Work``'s future (real
    completion, from the communication thread), or at ``wait()`` when the backend offers no
    future; ``timing.finish_ns`` spans the finalize step (from the start of the work's own finish
    step when it has one), set by the first ``wait()``. Both stamps replace the immutable record
    under a lock, so a reader on any thread sees a whole record.

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
        "_timing",
        "_stamps",
        "_timing_lock",
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
        timing: CommTiming,
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
        self._timing = timing.at_issue()
        self._stamps: dict[str, Any] = {}  # completion and finish, folded into _timing when read
        self._timing_lock = threading.Lock()
        if work is not None:
            self._stamp_on_completion(work)

    @property
    def timing(self) -> CommTiming:
        with self._timing_lock:
            if self._stamps:  # a new record only when read (telemetry, the link model)
                self._timing = dataclasses.replace(self._timing, **self._stamps)
                self._stamps = {}
            return self._timing

    def _stamp(self, **fields: Any) -> None:
        """Stamp ``fields``, those already known kept (first stamp wins)."""
        with self._timing_lock:
            timing, stamps = self._timing, self._stamps
            for name, value in fields.items():
                if name not in stamps and getattr(timing, name) is None:
                    stamps[name] = value

    def _stamp_on_completion(self, work: Work) -> None:
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError, NotImplementedError):
            return  # no future for this backend/op: wait() stamps instead
        future.then(self._on_complete)

    def _on_complete(self, _future) -> None:
        # Runs on the communication thread; only stamps the time (never reads the value, which
        # would raise here if the collective failed; wait() reports failures).
        self._stamp(completed_at_ns=time.perf_counter_ns())

    def is_completed(self) -> bool:
        """Whether the data has arrived (does not run finalize, never blocks)."""
        if self._done:
            return True
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
            inner = getattr(self._work, "timing", None)  # a handle used as the work
            # no future: the work's own stamp, else now
            self._stamp(completed_at_ns=(inner and inner.completed_at_ns) or time.perf_counter_ns())
            start_ns = time.perf_counter_ns()
            self._result = self._finalize()  # type: ignore[misc]
            if inner is not None and inner.finish_ns is not None:
                start_ns = min(start_ns, inner.finish_ns[0])
            self._stamp(finish_ns=(start_ns, time.perf_counter_ns()))
        except BaseException as exc:
            self._error = exc
        finally:
            self._done = True
            self._work = None
            self._finalize = None  # drop the buffers it closes over
