"""The spans of one MoE transfer, recorded around its comm handle (``dbo.timeline.transfers``)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from dbo.timeline import (
    RecordedTransfer,
    TimelineRecorder,
    record_transfer,
    set_timeline_recorder,
    transfer_result,
)
from distributed import CommTiming


class _Handle:
    """A hand-timed ``CommHandle`` built at ``t`` (``perf_counter_ns``): a notify in [t + 400,
    t + 900], issued at t + 1000, its bytes there at t + 3000, unpacked until t + 3500; ``wait``
    completes it."""

    def __init__(self, *, has_notify: bool = True) -> None:
        self.t = t = time.perf_counter_ns()
        notify = (t + 400, t + 900) if has_notify else None
        self.timing = CommTiming(issued_at_ns=t + 1_000, num_bytes=64, notify_ns=notify)
        self.num_waits = 0

    def is_completed(self) -> bool:
        return self.timing.completed_at_ns is not None

    def wait(self) -> str:
        self.num_waits += 1
        t = self.t
        self.timing = dataclasses.replace(
            self.timing, completed_at_ns=t + 3_000, finish_ns=(t + 3_000, t + 3_500)
        )
        return "rows"


@pytest.fixture
def recorder():
    rec = TimelineRecorder(rank=0)
    set_timeline_recorder(rec)
    try:
        yield rec
    finally:
        set_timeline_recorder(None)


def test_without_a_recorder_the_handle_comes_back_as_issued():
    handle = _Handle()
    assert record_transfer("dispatch", lambda: handle, record_window=True) is handle
    assert transfer_result(handle) == "rows" and handle.num_waits == 1


def test_issue_and_result_record_the_transfers_spans(recorder):
    handle = record_transfer("combine", _Handle, record_window=True)
    assert isinstance(handle, RecordedTransfer)
    t = handle.handle.t
    issue = [(s.name, s.cat, s.track, s.start_ns - t, s.end_ns - t) for s in recorder.spans()]
    assert issue[1:] == [
        ("combine_notify", "comm", "main comm", 400, 900),
        ("combine_prep", "compute", "main compute", 900, 1_000),
    ]
    assert issue[0][:3] == ("combine_prep", "compute", "main compute")  # issue start to notify
    assert issue[0][3] <= 0 and issue[0][4] == 400
    assert transfer_result(handle) == "rows"
    spans = recorder.spans(len(issue))
    assert [(s.name, s.cat, s.track) for s in spans] == [
        ("wait_combine", "wait", "main compute"),  # it blocked
        ("combine", "comm", "main comm"),
        ("combine_finish", "compute", "main compute"),
        ("combine_window", "window", "main comm"),
    ]
    comm = spans[1]
    assert (comm.start_ns - t, comm.end_ns - t, comm.args) == (1_000, 3_000, {"num_bytes": 64})
    assert (spans[2].start_ns - t, spans[2].end_ns - t) == (3_000, 3_500)
    assert spans[3].start_ns - t == 1_000


def test_a_recv_hooks_wait_is_one_wait_span_and_the_result_then_no_other(recorder):
    handle = record_transfer("dispatch", lambda: _Handle(has_notify=False))
    num_issue_spans = len(recorder)
    assert [s.name for s in recorder.spans()] == ["dispatch_prep"]
    handle.wait()  # the receive hook, in the other ubatch
    assert transfer_result(handle) == "rows"  # already there: no wait span
    names = [s.name for s in recorder.spans(num_issue_spans)]
    assert names == ["wait_dispatch", "dispatch", "dispatch_finish"]
