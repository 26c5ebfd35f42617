"""Timeline spans of the modular kernel's transfers (``dispatch``, ``combine``), recorded by a
wrapper around their comm handles: the kernel issues, yields and takes results, and this module
alone knows what the timeline gets (the spans: docs/profiling.md#recording---timeline-dir-dir).

Without a recorder or a torch profiler, ``record_transfer`` returns the plain handle after one
check, and ``transfer_result`` is its ``wait()`` after one more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from dbo.timeline.recorder import (
    CAT_COMM,
    CAT_COMPUTE,
    CAT_WAIT,
    CAT_WINDOW,
    is_timeline_active,
    record_span,
    timeline_span,
)

if TYPE_CHECKING:
    from distributed.comm_handle import CommHandle, CommTiming

T = TypeVar("T")


def record_transfer(
    op: str, issue: Callable[[], CommHandle[T]], *, record_window: bool = False
) -> CommHandle[T]:
    """``issue()``, the transfer ``op``; while the timeline records (``is_timeline_active``) its
    issue spans are recorded and its handle comes back as a ``RecordedTransfer``, else the handle
    itself. ``record_window``: ``transfer_result`` also records ``{op}_window``."""
    if not is_timeline_active():
        return issue()
    start_ns = time.perf_counter_ns()
    handle = issue()
    _record_issue(op, start_ns, handle.timing)
    return RecordedTransfer(op, handle, record_window=record_window)


def transfer_result(handle: CommHandle[T]) -> T:
    """The result of a transfer from ``record_transfer``, taken by the ubatch that issued it (once):
    ``handle.wait()``, blocking unless the data are there (a receive hook completed it)."""
    if type(handle) is RecordedTransfer:
        return handle.take()
    return handle.wait()


class RecordedTransfer(Generic[T]):
    """A ``CommHandle`` of the transfer ``op`` whose waits the timeline records.

    ``wait()`` (under DBO, the receive hook another ubatch runs) is one ``wait_{op}`` span.
    ``take()`` (``transfer_result``) is a ``wait_{op}`` span only if it blocks, then the transfer's
    spans: ``{op}`` on the comm track from issue to data arrival (``args``: ``num_bytes``, and
    behind an emulated link ``payload_ms``, when the bytes themselves were there), the receive-side
    unpacking ``{op}_finish`` (compute no overlap hides), and with ``record_window`` the
    ``{op}_window`` from issue to this moment (category ``window``, on the comm track).
    """

    __slots__ = ("handle", "op", "record_window")

    def __init__(self, op: str, handle: CommHandle[T], *, record_window: bool = False) -> None:
        self.op = op
        self.handle = handle
        self.record_window = record_window

    @property
    def timing(self) -> CommTiming:
        return self.handle.timing

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def wait(self) -> T:
        with timeline_span(f"wait_{self.op}", CAT_WAIT):
            return self.handle.wait()

    def take(self) -> T:
        """The result, recorded as above; call once, from the issuing ubatch."""
        if self.handle.is_completed():
            result = self.handle.wait()  # does not block: at most runs the finalize step
        else:
            with timeline_span(f"wait_{self.op}", CAT_WAIT):
                result = self.handle.wait()  # blocking wait (group timeout) in CommHandle.wait
        timing = self.handle.timing
        _record_comm(self.op, timing)
        if self.record_window:
            _span(f"{self.op}_window", CAT_WINDOW, timing.issued_at_ns, time.perf_counter_ns())
        return result


def _span(name: str, cat: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
    """``record_span`` on this thread's compute track for compute spans, else its comm track."""
    kind = "compute" if cat == CAT_COMPUTE else "comm"
    record_span(name, cat=cat, start_ns=start_ns, end_ns=end_ns, kind=kind, args=args)


def _record_issue(op: str, start_ns: int, timing: CommTiming) -> None:
    """Spans of one issue: the CPU work before the payload leaves (``{op}_prep``, compute), split
    by the blocking count exchange if the backend made one (``{op}_notify``, comm)."""
    issued_at_ns = max(timing.issued_at_ns, start_ns)
    prep_end_ns = issued_at_ns if timing.notify_ns is None else timing.notify_ns[0]
    _span(f"{op}_prep", CAT_COMPUTE, start_ns, prep_end_ns)
    if timing.notify_ns is not None:
        notify_start, notify_end = timing.notify_ns
        _span(f"{op}_notify", CAT_COMM, notify_start, notify_end)
        _span(f"{op}_prep", CAT_COMPUTE, notify_end, issued_at_ns)


def _record_comm(op: str, timing: CommTiming) -> None:
    """Spans of one completed transfer: ``{op}`` (comm) and ``{op}_finish`` (compute; in whichever
    ubatch completed it)."""
    args = {"num_bytes": timing.num_bytes}
    if timing.payload_at_ns is not None:  # behind an emulated link: when the bytes were there
        args["payload_ms"] = (timing.payload_at_ns - timing.issued_at_ns) / 1e6
    end_ns = timing.completed_at_ns or time.perf_counter_ns()
    _span(op, CAT_COMM, timing.issued_at_ns, end_ns, args)
    if timing.finish_ns is not None:
        _span(f"{op}_finish", CAT_COMPUTE, *timing.finish_ns)
