"""Overlap metrics of a recorded timeline, per engine step and rank (``step_metrics``,
``summarize``): compute C, communication M, exposed and hidden communication, ideal and achieved
speedups. Definitions: docs/profiling.md, "Overlap metrics: definitions"."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from dbo.timeline.recorder import CAT_BATON, CAT_COMM, CAT_COMPUTE, CAT_GPU, CAT_STEP, CAT_WAIT

Interval = tuple[int, int]  # [start_ns, end_ns)


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """One timeline event of one rank; times in ``perf_counter_ns`` nanoseconds."""

    rank: int
    name: str
    cat: str
    track: str
    start_ns: int
    end_ns: int
    args: dict

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(f"span {self.name!r}: end_ns {self.end_ns} < start_ns {self.start_ns}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """Overlap metrics of one engine step on one rank (milliseconds unless named otherwise)."""

    rank: int
    step: int
    is_ubatched: bool
    num_ubatches: int  # ubatches the step ran (1 without microbatching)
    num_tokens: int
    step_ms: float
    compute_ms: float
    compute_clock: str  # "device": C from the step's gpu spans; "host": from its compute spans
    comm_ms: float
    exposed_comm_ms: float
    hidden_comm_ms: float
    overlap_ratio: float  # hidden / M; 0 when M is 0
    ideal_ms: float  # max(C, M)
    ideal_speedup: float  # (C + M) / max(C, M); 1 when both are 0
    achieved_speedup: float  # (C + M) / step time
    fraction_of_ideal: float  # max(C, M) / step time
    wait_ms: float
    num_baton_passes: int
    baton_pass_us_median: float  # 0 when there was none

    def as_dict(self) -> dict:
        return asdict(self)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones (empty ones dropped)."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total(intervals: Sequence[Interval]) -> int:
    """Summed length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sorted disjoint interval lists (two-pointer sweep)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(spans: Iterable[Span], cat: str, window: Interval) -> list[Interval]:
    lo, hi = window
    return [
        (max(s.start_ns, lo), min(s.end_ns, hi))
        for s in spans
        if s.cat == cat and s.end_ns > lo and s.start_ns < hi
    ]


def _ratio(num: float, den: float, empty: float) -> float:
    return num / den if den > 0 else empty


def step_metrics(spans: Sequence[Span]) -> list[StepMetrics]:
    """Metrics of every ``step`` span in ``spans`` (one or many ranks), ordered by rank and time.

    Raises:
        ValueError: if a rank has no ``step`` span (nothing to measure against).
    """
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        by_rank[span.rank].append(span)
    results: list[StepMetrics] = []
    for rank in sorted(by_rank):
        rank_spans = by_rank[rank]
        steps = sorted((s for s in rank_spans if s.cat == CAT_STEP), key=lambda s: s.start_ns)
        if not steps:
            raise ValueError(f"rank {rank} has no {CAT_STEP!r} spans: cannot cut it into steps")
        for step in steps:
            results.append(_one_step(rank, step, rank_spans))
    return results


def _one_step(rank: int, step: Span, spans: Sequence[Span]) -> StepMetrics:
    window = (step.start_ns, step.end_ns)
    device_compute = union(_clip(spans, CAT_GPU, window))
    compute = device_compute or union(_clip(spans, CAT_COMPUTE, window))
    comm = union(_clip(spans, CAT_COMM, window))
    c_ns, m_ns, step_ns = total(compute), total(comm), step.end_ns - step.start_ns
    hidden_ns = total(intersection(comm, compute))
    batons = [e - s for s, e in _clip(spans, CAT_BATON, window)]
    ideal_ns = max(c_ns, m_ns)
    return StepMetrics(
        rank=rank,
        step=int(step.args.get("step", -1)),
        is_ubatched=bool(step.args.get("is_ubatched", False)),
        # timelines written before N ubatches existed: two when microbatched
        num_ubatches=int(
            step.args.get("num_ubatches", 2 if step.args.get("is_ubatched", False) else 1)
        ),
        num_tokens=int(step.args.get("num_tokens", 0)),
        step_ms=step_ns / 1e6,
        compute_ms=c_ns / 1e6,
        compute_clock="device" if device_compute else "host",
        comm_ms=m_ns / 1e6,
        exposed_comm_ms=(m_ns - hidden_ns) / 1e6,
        hidden_comm_ms=hidden_ns / 1e6,
        overlap_ratio=_ratio(hidden_ns, m_ns, 0.0),
        ideal_ms=ideal_ns / 1e6,
        ideal_speedup=_ratio(c_ns + m_ns, ideal_ns, 1.0),
        achieved_speedup=_ratio(c_ns + m_ns, step_ns, 1.0),
        fraction_of_ideal=_ratio(ideal_ns, step_ns, 1.0),
        wait_ms=total(union(_clip(spans, CAT_WAIT, window))) / 1e6,
        num_baton_passes=len(batons),
        baton_pass_us_median=statistics.median(batons) / 1e3 if batons else 0.0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryMetrics:
    """Totals over a set of steps (ratios from the totals, not averaged ratios)."""

    num_steps: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    overlap_ratio: float
    ideal_speedup: float
    achieved_speedup: float
    fraction_of_ideal: float
    baton_pass_us_median: float  # median of per-step medians; 0 without passes

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(steps: Sequence[StepMetrics]) -> SummaryMetrics:
    """Sum C, M, exposed communication and step time over ``steps`` and derive the ratios."""
    step_ms = sum(s.step_ms for s in steps)
    c = sum(s.compute_ms for s in steps)
    m = sum(s.comm_ms for s in steps)
    exposed = sum(s.exposed_comm_ms for s in steps)
    batons = [s.baton_pass_us_median for s in steps if s.num_baton_passes]
    return SummaryMetrics(
        num_steps=len(steps),
        step_ms=step_ms,
        compute_ms=c,
        comm_ms=m,
        exposed_comm_ms=exposed,
        overlap_ratio=_ratio(m - exposed, m, 0.0),
        ideal_speedup=_ratio(c + m, max(c, m), 1.0),
        achieved_speedup=_ratio(c + m, step_ms, 1.0),
        fraction_of_ideal=_ratio(max(c, m), step_ms, 1.0),
        baton_pass_us_median=statistics.median(batons) if batons else 0.0,
    )


def spans_from_recorder(recorder, start: int = 0) -> list[Span]:
    """``Span`` s of a live ``dbo.TimelineRecorder`` from its ``start``-th span on (for in-process
    metrics, e.g. the benchmark)."""
    return [
        Span(
            rank=recorder.rank,
            name=s.name,
            cat=s.cat,
            track=s.track,
            start_ns=s.start_ns,
            end_ns=s.end_ns,
            args=s.args,
        )
        for s in recorder.spans(start)
    ]


def spans_from_chrome_trace(trace: dict, *, rank: int | None = None) -> list[Span]:
    """``Span`` s of a Chrome trace written by ``TimelineRecorder`` or merged by ``launch.timeline``
    (``pid`` = rank unless ``rank`` is given; tracks named by ``thread_name`` events).

    Raises:
        ValueError: if the trace has no ``traceEvents`` list.
    """
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        start_ns = round(e["ts"] * 1000)
        spans.append(
            Span(
                rank=e["pid"] if rank is None else rank,
                name=e["name"],
                cat=e.get("cat", ""),
                track=names.get((e["pid"], e["tid"]), str(e["tid"])),
                start_ns=start_ns,
                end_ns=start_ns + round(e["dur"] * 1000),
                args=e.get("args", {}),
            )
        )
    return spans
