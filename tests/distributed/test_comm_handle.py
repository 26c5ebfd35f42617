"""Both handles satisfy the CommHandle protocol the modular kernel reads."""

from __future__ import annotations

import datetime
import time

from distributed import CollectiveHandle, CommHandle, CompletedHandle
from distributed.all2all.deepep_events import EmulatedTransfer


def test_completed_and_collective_handles_are_comm_handles():
    done = CompletedHandle("value")
    assert isinstance(done, CommHandle)
    assert done.is_completed() and done.wait() == "value"
    assert done.num_bytes == 0 and done.notify_ns is None
    assert done.completed_at_ns == done.issued_at_ns
    handle = CollectiveHandle(
        op="test", rank=0, timeout=datetime.timedelta(seconds=5), work=None,
        finalize=lambda: 3, issued_at_ns=time.perf_counter_ns(), num_bytes=8, notify_ns=(1, 2),
    )  # fmt: skip
    assert isinstance(handle, CommHandle)
    assert handle.finish_ns is None
    assert handle.wait() == 3 and handle.notify_ns == (1, 2)
    assert not isinstance(object(), CommHandle)


def test_finish_ns_spans_the_receive_side_work_of_nested_handles():
    """The unpacking a handle's work did (the emulated DeepEP transfer, itself a
    CollectiveHandle, inside an adapter's handle) counts as the outer handle's finish step too: it starts at the inner one's."""
    timeout = datetime.timedelta(seconds=5)

    def slow_finalize():
        time.sleep(0.01)  # the receive-side work
        return "rows"

    inner = EmulatedTransfer(
        op="inner", rank=0, timeout=timeout, pending=(None, None), finish=slow_finalize,
        issued_at_ns=time.perf_counter_ns(), num_bytes=0, link=None,
    )  # fmt: skip
    outer = CollectiveHandle(
        op="outer", rank=0, timeout=timeout, work=inner, finalize=lambda: "result",
        issued_at_ns=inner.issued_at_ns, num_bytes=0,
    )  # fmt: skip
    assert outer.wait() == "result"
    start, end = outer.finish_ns
    assert start == inner.finish_ns[0] and end >= inner.finish_ns[1]
    assert end - start >= 10_000_000
    # the data had arrived before the inner unpacking began
    assert outer.completed_at_ns is not None and outer.completed_at_ns <= start
