"""Device-timed compute spans: a fake clock's marks land as ``gpu`` spans on their own tracks,
resolved once per step; the overlap metrics read them instead of the host compute spans; the CUDA
clock times a sleeping kernel (``gpu``, skipped without CUDA)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from dbo import UBatchWrapper, dbo_yield, make_ubatch_slices
from dbo.timeline import CudaDeviceClock, TimelineRecorder, set_timeline_recorder, timeline_span
from dbo.timeline.metrics import spans_from_recorder, step_metrics
from dbo.timeline.recorder import CAT_WAIT, blocking_comm_span, timeline_step
from dbo.timeline.trace import merge
from moe.platforms.interface import CpuPlatform, CudaPlatform
from tests.helpers.attention_metadata import make_slicing_metadata


class FakeClock:
    """Mark ``k`` (0, 1, ...) completes at ``origin_ns + 1000 * (k + 1)``; ``capturing`` makes
    ``mark`` return None, as the CUDA clock does under graph capture."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.num_marks = 0
        self.resolved: list[list[int]] = []  # the handles of each resolve call
        self.capturing = False

    def mark(self) -> int | None:
        if self.capturing:
            return None
        self.num_marks += 1
        return self.num_marks - 1

    def resolve(self, marks):
        self.resolved.append(list(marks))
        return [self.origin_ns + 1000 * (k + 1) for k in marks]


@pytest.fixture
def clock_and_recorder():
    clock = FakeClock(origin_ns=time.perf_counter_ns() + 10_000_000)  # 10 ms after now
    rec = TimelineRecorder(rank=0, device_clock=clock)
    set_timeline_recorder(rec)
    try:
        yield clock, rec
    finally:
        set_timeline_recorder(None)


def test_compute_spans_get_gpu_spans_resolved_once_at_the_end_of_the_step(clock_and_recorder):
    clock, rec = clock_and_recorder
    with timeline_step(0):
        with timeline_span("attention"):  # marks 0, 1
            pass
        with timeline_span("wait_dispatch", CAT_WAIT), blocking_comm_span("dp_vote"):
            pass  # neither is compute: no marks
        with timeline_span("experts"):  # marks 2, 3
            pass
        assert clock.resolved == []  # nothing resolved while the step runs
    assert clock.resolved == [[0, 1, 2, 3]]
    host_end = max(s.end_ns for s in rec.spans() if s.cat != "gpu")
    gpu = [s for s in rec.spans() if s.cat == "gpu"]
    o = clock.origin_ns
    assert [(s.name, s.track, s.start_ns, s.end_ns) for s in gpu] == [
        ("attention", "main gpu", o + 1000, o + 2000),
        ("experts", "main gpu", o + 3000, o + 4000),
    ]
    assert all(s.start_ns > host_end for s in gpu)  # the fake device ran after the launches
    assert gpu[1].args["queued_ms"] > 0
    with timeline_step(1):  # a step without compute spans resolves nothing
        pass
    assert len(clock.resolved) == 1


def test_marks_the_clock_refuses_and_backwards_spans_leave_no_gpu_span(clock_and_recorder):
    clock, rec = clock_and_recorder
    with timeline_step(0):
        clock.capturing = True
        with timeline_span("graph"):
            pass
        clock.capturing = False
    assert clock.resolved == []
    assert [s.track for s in rec.spans()] == ["main compute", "engine step"]
    # a span whose end mark completed before its start mark (it ended on another stream)
    rec.add_device_marks("x", track="main gpu", start_mark=5, end_mark=2, host_start_ns=0)
    assert rec.resolve_device_spans() == 0 and clock.resolved == [[5, 2]]


def test_ubatch_threads_get_their_own_gpu_tracks_in_display_order(clock_and_recorder, tmp_path):
    clock, rec = clock_and_recorder

    def model_fn(input_ids, positions):
        with timeline_span("attention"):
            pass
        dbo_yield()
        return input_ids

    md = make_slicing_metadata([3, 3], [3, 3])
    input_ids = torch.arange(6)
    with timeline_step(0):
        with timeline_span("sample"):
            UBatchWrapper(model_fn, timeout_s=5)(
                input_ids, input_ids, make_ubatch_slices(md.query_start_loc, 6)
            )
        with blocking_comm_span("dp_vote"):
            pass
    assert len(clock.resolved) == 1 and len(clock.resolved[0]) == 6
    gpu_tracks = sorted((s.name, s.track) for s in rec.spans() if s.cat == "gpu")
    assert gpu_tracks == [
        ("attention", "ubatch0 gpu"),
        ("attention", "ubatch1 gpu"),
        ("sample", "main gpu"),
    ]
    expected = ["main compute", "main gpu", "main comm", "ubatch0 compute", "ubatch0 gpu"]
    expected += ["ubatch1 compute", "ubatch1 gpu"]
    for trace in (rec.chrome_trace(), merge(spans_from_recorder(rec))):
        events = trace["traceEvents"]
        names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        names = {t: n for t, n in names.items() if n != "engine step"}
        assert [names[t] for t in sorted(names)] == expected


def test_cpu_platforms_have_no_device_clock():
    cpu = torch.device("cpu")
    assert CpuPlatform().device_clock(cpu) is None
    assert CudaPlatform().device_clock(cpu) is None


class FakeCudaEvent:
    """A ``torch.cuda.Event`` whose record time is the host's, so ``elapsed_time`` is known."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.recorded_ns = None

    def record(self, stream=None) -> None:
        self.recorded_ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        return (end.recorded_ns - self.recorded_ns) / 1e6  # ms, as torch's


def test_cuda_clock_arithmetic_with_fake_events(monkeypatch):
    # the CUDA clock's calls, answered on the host: resolved times are the record times, at most
    # the reference's settle time late, and never before the record
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    clock = CudaDeviceClock(torch.device("cuda", 0))
    for _ in range(2):  # the second round is timed from the reference re-recorded by resolve
        marks = [clock.mark(), clock.mark()]
        times = clock.resolve(marks)
        for mark, resolved_ns in zip(marks, times, strict=True):
            assert mark.recorded_ns <= resolved_ns < mark.recorded_ns + 1_000_000
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert clock.mark() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clock_times_a_sleeping_kernel_after_its_launch():
    device = torch.device("cuda", torch.cuda.current_device())
    rec = TimelineRecorder(rank=0, device_clock=CudaPlatform().device_clock(device))
    set_timeline_recorder(rec)
    try:
        with timeline_step(0):
            with timeline_span("sleep"):
                torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz; the launch takes µs
            torch.cuda.synchronize(device)  # the step's end waits, as the sampled-token read does
        after_resolve_ns = time.perf_counter_ns()
    finally:
        set_timeline_recorder(None)
    (host,) = [s for s in rec.spans() if s.cat == "compute"]
    (gpu,) = [s for s in rec.spans() if s.cat == "gpu"]
    (step,) = [s for s in rec.spans() if s.cat == "step"]
    assert gpu.track == "main gpu"
    assert host.start_ns <= gpu.start_ns < gpu.end_ns <= after_resolve_ns
    assert gpu.end_ns < step.end_ns + 1_000_000  # the reference's host time is µs late at most
    assert gpu.duration_ns > 10 * host.duration_ns and gpu.duration_ns > 5_000_000
    (m,) = step_metrics(spans_from_recorder(rec))
    assert m.compute_clock == "device"
