"""The timeline recorder: spans land on the right tracks and the Chrome trace is valid JSON."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from dbo import (
    TimelineRecorder,
    UBatchWrapper,
    dbo_yield,
    get_timeline_recorder,
    make_ubatch_slices,
    record_comm_span,
    set_timeline_recorder,
    timeline_span,
)
from tests.helpers.attention_metadata import make_slicing_metadata


@pytest.fixture
def recorder():
    rec = TimelineRecorder(rank=3)
    set_timeline_recorder(rec)
    try:
        yield rec
    finally:
        set_timeline_recorder(None)


def test_no_recorder_is_a_no_op():
    assert get_timeline_recorder() is None
    with timeline_span("attention"):
        pass
    record_comm_span("dispatch", start_ns=1, end_ns=2)


def test_spans_outside_dbo_go_to_the_main_tracks(recorder):
    assert get_timeline_recorder() is recorder
    with timeline_span("router"):
        time.sleep(0.001)
    record_comm_span("dispatch", start_ns=1_000, end_ns=5_500, args={"num_bytes": 8})
    with pytest.raises(KeyError), timeline_span("experts", cat="moe"):
        raise KeyError("still recorded")
    spans = recorder.spans()
    assert [(s.name, s.cat, s.track) for s in spans] == [
        ("router", "compute", "main compute"),
        ("dispatch", "comm", "main comm"),
        ("experts", "moe", "main compute"),
    ]
    assert spans[0].duration_ns >= 1_000_000
    assert spans[1].duration_ns == 4_500 and spans[1].args == {"num_bytes": 8}


def test_compute_spans_carry_the_thread_cpu_time(recorder):
    with timeline_span("sleeping"):
        time.sleep(0.05)  # wall time, next to no CPU
    with timeline_span("spinning"):
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:
            pass
    sleeping, spinning = recorder.spans()
    for span in (sleeping, spinning):
        assert 0.0 <= span.args["cpu_ms"] <= span.duration_ns / 1e6 + 1.0
    assert sleeping.args["cpu_ms"] < 20.0 <= sleeping.duration_ns / 1e6
    assert spinning.args["cpu_ms"] > sleeping.args["cpu_ms"]


def test_spans_of_ubatch_threads_go_to_their_tracks(recorder):
    def model_fn(input_ids, positions):
        with timeline_span("attention"):
            pass
        now = time.perf_counter_ns()
        record_comm_span("dispatch", start_ns=now, end_ns=now + 10)
        dbo_yield()
        return input_ids

    md = make_slicing_metadata([3, 3], [3, 3])
    input_ids = torch.arange(6)
    slices = make_ubatch_slices(md.query_start_loc, 6)
    UBatchWrapper(model_fn, timeout_s=5)(input_ids, input_ids, slices)
    spans = recorder.spans()
    assert sorted((s.name, s.track) for s in spans if s.cat != "baton") == [
        ("attention", "ubatch0 compute"),
        ("attention", "ubatch1 compute"),
        ("dispatch", "ubatch0 comm"),
        ("dispatch", "ubatch1 comm"),
    ]
    # 0 -> 1 (ubatch 0 yields), 1 -> 0 (ubatch 1 yields), 0 -> 1 (ubatch 0 exits)
    batons = [s for s in spans if s.cat == "baton"]
    assert [s.track for s in batons] == ["ubatch1 compute", "ubatch0 compute", "ubatch1 compute"]
    assert all(0 <= s.duration_ns < 1_000_000_000 for s in batons)


def test_chrome_trace_is_valid_json(recorder, tmp_path):
    recorder.add_span(
        "attention", cat="compute", start_ns=2_000, end_ns=5_000, track="ubatch0 compute"
    )
    recorder.add_span(
        "combine",
        cat="comm",
        start_ns=4_000,
        end_ns=9_500,
        track="ubatch1 comm",
        args={"bytes": 64},
    )
    path = tmp_path / "trace.json"
    recorder.write_chrome_trace(path)
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete == [
        {
            "name": "attention",
            "cat": "compute",
            "ph": "X",
            "ts": 2.0,
            "dur": 3.0,
            "pid": 3,
            "tid": 1,
            "args": {},
        },
        {
            "name": "combine",
            "cat": "comm",
            "ph": "X",
            "ts": 4.0,
            "dur": 5.5,
            "pid": 3,
            "tid": 2,
            "args": {"bytes": 64},
        },
    ]
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert names == {1: "ubatch0 compute", 2: "ubatch1 comm"}


def test_concurrent_appends_are_all_kept():
    rec = TimelineRecorder(rank=0)

    def add_many(track):
        for i in range(2_000):
            rec.add_span("x", cat="compute", start_ns=i, end_ns=i + 1, track=track)

    threads = [threading.Thread(target=add_many, args=(f"t{k}",)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(rec.spans()) == 8_000
    rec.clear()
    assert rec.spans() == []


def test_invalid_spans_are_rejected():
    rec = TimelineRecorder(rank=0)
    with pytest.raises(ValueError, match="end_ns=1 is before start_ns=2"):
        rec.add_span("x", cat="compute", start_ns=2, end_ns=1, track="main compute")
    with pytest.raises(ValueError, match="rank must be >= 0"):
        TimelineRecorder(rank=-1)
