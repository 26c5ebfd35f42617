"""Both handles satisfy the CommHandle protocol the modular kernel reads."""

from __future__ import annotations

import datetime
import time

from distributed import CollectiveHandle, CommHandle, CompletedHandle


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
    assert handle.wait() == 3 and handle.notify_ns == (1, 2)
    assert not isinstance(object(), CommHandle)
