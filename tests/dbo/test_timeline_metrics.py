"""Overlap metrics on hand-made span sets, and the merge's one-event-per-time-per-track property."""

from __future__ import annotations

import json

import pytest

from dbo.timeline.metrics import (
    Span,
    intersection,
    spans_from_chrome_trace,
    step_metrics,
    summarize,
    union,
)
from dbo.timeline.trace import assign_lanes, merge, overlapping_events
from launch.timeline import main, parse_steps

MS = 1_000_000  # ns


def span(name, cat, start_ms, end_ms, track, rank=0, **args):
    return Span(
        rank=rank,
        name=name,
        cat=cat,
        track=track,
        start_ns=int(start_ms * MS),
        end_ns=int(end_ms * MS),
        args=args,
    )


def dbo_step(rank=0, offset=0.0, step=0):
    """Step [0, 40] ms: compute 0-10 and 20-30 (two ubatches), comm 5-25 and 22-35 (overlapping
    each other on different ubatches), a 1 ms wait, two baton passes of 10 and 30 us."""
    o = offset
    return [
        span("step", "step", o + 0, o + 40, "engine step", rank, step=step, is_ubatched=True),
        span("layer0.attention", "compute", o + 0, o + 10, "ubatch0 compute", rank),
        span("layer0.experts", "compute", o + 20, o + 30, "ubatch1 compute", rank),
        span("layer0.dispatch", "comm", o + 5, o + 25, "ubatch0 comm", rank),
        span("layer0.combine", "comm", o + 22, o + 35, "ubatch1 comm", rank),
        span("layer0.wait_dispatch", "wait", o + 36, o + 37, "ubatch0 compute", rank),
        span("baton pass", "baton", o + 10, o + 10.01, "ubatch1 compute", rank),
        span("baton pass", "baton", o + 30, o + 30.03, "ubatch0 compute", rank),
        span("outside", "compute", o + 50, o + 60, "main compute", rank),  # not in the step
    ]


def test_interval_arithmetic():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert intersection([(0, 3), (5, 8)], [(2, 6), (7, 20)]) == [(2, 3), (5, 6), (7, 8)]


def test_step_metrics_of_a_hand_made_step():
    (m,) = step_metrics(dbo_step())
    # C = 10 + 10; M = union(5-25, 22-35) = 5-35 = 30; hidden = 5-10 and 20-30 = 15
    assert m.step_ms == pytest.approx(40)
    assert m.compute_ms == pytest.approx(20)
    assert m.comm_ms == pytest.approx(30)
    assert m.hidden_comm_ms == pytest.approx(15)
    assert m.exposed_comm_ms == pytest.approx(15)
    assert m.overlap_ratio == pytest.approx(0.5)
    assert m.ideal_ms == pytest.approx(30)
    assert m.ideal_speedup == pytest.approx(50 / 30)
    assert m.achieved_speedup == pytest.approx(50 / 40)
    assert m.fraction_of_ideal == pytest.approx(30 / 40)
    assert m.wait_ms == pytest.approx(1)
    assert m.num_baton_passes == 2 and m.baton_pass_us_median == pytest.approx(20)
    assert m.is_ubatched and m.step == 0
    assert m.compute_clock == "host"


def test_a_step_with_gpu_spans_counts_those_as_compute():
    # the host compute spans (0-10, 20-30) only launched the work; the device ran it 2-14, 22-34
    spans = dbo_step() + [
        span("layer0.attention", "gpu", 2, 14, "ubatch0 gpu"),
        span("layer0.experts", "gpu", 22, 34, "ubatch1 gpu"),
    ]
    (m,) = step_metrics(spans)
    # C = 12 + 12; M = 5-35 = 30; hidden = 5-14 and 22-34 = 21
    assert m.compute_clock == "device"
    assert m.compute_ms == pytest.approx(24)
    assert m.comm_ms == pytest.approx(30)
    assert m.hidden_comm_ms == pytest.approx(21)
    assert m.ideal_speedup == pytest.approx(54 / 30)
    # per step: a later step without gpu spans (one that only captured graphs) reads the host's
    (_, host) = step_metrics(spans + dbo_step(offset=100, step=1))
    assert host.compute_clock == "host" and host.compute_ms == pytest.approx(20)


def test_steps_with_several_ubatch_counts_get_a_summary_row_each():
    from launch.timeline import metric_rows

    three = [
        span("step", "step", 100, 140, "engine step", step=1, is_ubatched=True, num_ubatches=3),
        span("layer0.attention", "compute", 100, 110, "ubatch2 compute"),
    ]
    off = [span("step", "step", 200, 210, "engine step", step=2, is_ubatched=False)]
    metrics = step_metrics(dbo_step() + three + off)
    # a step without the arg (an older timeline) ran two ubatches if microbatched, else one
    assert [m.num_ubatches for m in metrics] == [2, 3, 1]
    labels = [label for label, _ in metric_rows(metrics)]
    assert labels == ["rank 0 all", "rank 0 DBO N=2", "rank 0 DBO N=3", "overall"]
    assert [label for label, _ in metric_rows(metrics[:1])][1] == "rank 0 DBO"


def test_summary_sums_before_dividing_and_empty_cases():
    spans = dbo_step(step=0) + [
        span("step", "step", 100, 110, "engine step", step=1),
        span("x", "compute", 100, 110, "main compute"),
    ]
    steps = step_metrics(spans)
    assert [m.comm_ms for m in steps] == pytest.approx([30, 0])
    assert steps[1].overlap_ratio == 0 and steps[1].ideal_speedup == 1
    s = summarize(steps)
    assert s.num_steps == 2 and s.step_ms == pytest.approx(50)
    assert s.overlap_ratio == pytest.approx(15 / 30)
    assert s.ideal_speedup == pytest.approx(60 / 30)
    with pytest.raises(ValueError, match="rank 0 has no 'step' spans"):
        step_metrics([span("x", "compute", 0, 1, "main compute")])


def test_merge_moves_overlapping_events_to_extra_lanes_and_keeps_all():
    spans = dbo_step(rank=0) + dbo_step(rank=1, offset=0.5)
    # two overlapping events on one track (as a buggy recorder could produce), before ubatch0's
    # dispatch [5, 25]: "a" keeps the track, "b" (nested in "a") goes to a second lane
    spans += [
        span("a", "comm", 1, 4, "ubatch0 comm"),
        span("b", "comm", 2, 3, "ubatch0 comm"),
    ]
    lanes = assign_lanes(spans)
    assert {lanes[len(spans) - 2], lanes[len(spans) - 1]} == {"ubatch0 comm", "ubatch0 comm #2"}
    trace = merge(spans)
    assert overlapping_events(trace) == []
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(spans)
    assert min(e["ts"] for e in complete) == 0
    # round trip: the merged trace gives back the same metrics (per rank = pid)
    again = step_metrics(spans_from_chrome_trace(trace))
    assert [m.overlap_ratio for m in again] == pytest.approx(
        [m.overlap_ratio for m in step_metrics(spans)]
    )
    # the checker itself finds overlaps in an unmerged trace
    raw = {
        "traceEvents": [
            {"ph": "X", "name": "a", "ts": 0, "dur": 3, "pid": 0, "tid": 1},
            {"ph": "X", "name": "b", "ts": 2, "dur": 3, "pid": 0, "tid": 1},
        ]
    }
    assert len(overlapping_events(raw)) == 1


def test_cli_merges_rank_files_and_draws_png(tmp_path, capsys):
    from dbo import TimelineRecorder

    for rank in (0, 1):
        rec = TimelineRecorder(rank=rank)
        for s in dbo_step(rank=rank, offset=rank * 0.2):
            rec.add_span(
                s.name,
                cat=s.cat,
                start_ns=s.start_ns,
                end_ns=s.end_ns,
                track=s.track,
                args=s.args,
            )
        rec.write_chrome_trace(tmp_path / f"rank{rank}.json")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no overlaps on any track" in out and "overall" in out and "0.50" in out
    merged = json.loads((tmp_path / "timeline.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert parse_steps("1,3-5") == [1, 3, 4, 5]
    with pytest.raises(ValueError, match="not N or N-M"):
        parse_steps("x")
    assert main([str(tmp_path / "missing")]) == 2
