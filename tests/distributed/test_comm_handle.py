"""The handles satisfy the CommHandle protocol the modular kernel reads (``wait``, ``is_completed``,
``timing``), and a handle's telemetry is one ``CommTiming`` record."""

from __future__ import annotations

import dataclasses
import datetime
import time

import pytest

from distributed import CollectiveHandle, CommHandle, CommTiming, CompletedHandle
from distributed.all2all.deepep_emulation import EmulatedTransfer

TIMEOUT = datetime.timedelta(seconds=5)


def test_completed_and_collective_handles_are_comm_handles():
    done = CompletedHandle("value")
    assert isinstance(done, CommHandle)
    assert done.is_completed() and done.wait() == "value"
    assert done.timing.num_bytes == 0 and done.timing.notify_ns is None
    assert done.timing.completed_at_ns == done.timing.issued_at_ns
    handle = CollectiveHandle(
        op="test",
        rank=0,
        timeout=TIMEOUT,
        work=None,
        finalize=lambda: 3,
        timing=CommTiming(issued_at_ns=time.perf_counter_ns(), num_bytes=8, notify_ns=(1, 2)),
    )
    assert isinstance(handle, CommHandle)
    assert handle.timing.finish_ns is None and handle.timing.completed_at_ns is None
    assert handle.wait() == 3 and handle.timing.notify_ns == (1, 2)
    assert not isinstance(object(), CommHandle)


def test_timing_is_one_frozen_record_replaced_when_stamped():
    issued = time.perf_counter_ns()
    handle = CollectiveHandle(
        op="test",
        rank=0,
        timeout=TIMEOUT,
        work=None,
        finalize=lambda: 3,
        timing=CommTiming(issued_at_ns=issued, num_bytes=8, num_recv_bytes=24),
    )
    before = handle.timing
    assert isinstance(before, CommTiming) and before.num_link_bytes == 24
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.completed_at_ns = 1  # type: ignore[misc]
    handle.wait()
    after = handle.timing
    assert before.completed_at_ns is None and before.finish_ns is None  # a record never changes
    assert after.issued_at_ns == issued and (after.num_bytes, after.num_recv_bytes) == (8, 24)
    assert issued <= after.completed_at_ns <= after.finish_ns[0] <= after.finish_ns[1]
    assert dataclasses.replace(after, completed_at_ns=None, finish_ns=None) == before


def test_comm_timing_rejects_negative_sizes():
    with pytest.raises(ValueError, match=r"num_bytes \(-1\)"):
        CommTiming(issued_at_ns=0, num_bytes=-1)
    with pytest.raises(ValueError, match=r"num_recv_bytes \(-2\)"):
        CommTiming(issued_at_ns=0, num_bytes=0, num_recv_bytes=-2)


def test_finish_ns_spans_the_receive_side_work_of_nested_handles():
    """The unpacking a handle's work did (the emulated DeepEP transfer, itself a
    CollectiveHandle, inside an adapter's handle) counts as the outer handle's finish step too:
    it starts at the inner one's."""

    def slow_finalize():
        time.sleep(0.01)  # the receive-side work
        return "rows"

    inner = EmulatedTransfer(
        op="inner",
        rank=0,
        timeout=TIMEOUT,
        pending=(None, None),
        finish=slow_finalize,
        timing=CommTiming(issued_at_ns=time.perf_counter_ns(), num_bytes=0),
    )
    outer = CollectiveHandle(
        op="outer",
        rank=0,
        timeout=TIMEOUT,
        work=inner,
        finalize=lambda: "result",
        timing=inner.timing,
    )
    assert outer.wait() == "result"
    start, end = outer.timing.finish_ns
    assert start == inner.timing.finish_ns[0] and end >= inner.timing.finish_ns[1]
    assert end - start >= 10_000_000
    # the data had arrived before the inner unpacking began
    assert outer.timing.completed_at_ns is not None and outer.timing.completed_at_ns <= start
