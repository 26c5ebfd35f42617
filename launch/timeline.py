"""Merge per-rank timelines, print overlap metrics, render a PNG: ``python -m launch.timeline DIR``.

``DIR`` holds the ``rank{r}.json`` Chrome traces an entry point wrote with ``--timeline-dir``.
Writes ``DIR/timeline.json`` (one Chrome-trace / Perfetto file: a process per rank, a track per
ubatch and kind, time 0 = the earliest event; ranks on one host share ``perf_counter_ns``'s clock)
and ``DIR/timeline.png`` (lanes per rank and ubatch of the chosen steps), and prints per-rank and
overall metrics (see ``launch.timeline_metrics`` for the definitions).

Perfetto drops complete events that partially overlap another on the same track, so the merge
checks every track and moves an overlapping event to an extra lane (``<track> #2``); the merged
file is verified to have no two overlapping events on one track.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from launch.timeline_metrics import (
    Span,
    StepMetrics,
    spans_from_chrome_trace,
    step_metrics,
    summarize,
)

_RANK_FILE = re.compile(r"rank(\d+)\.json$")
_KIND_ORDER = {"compute": "0", "comm": "1"}


def _track_order(track: str) -> tuple:
    """engine step, main compute/comm, ubatch0 compute/comm, ubatch1 ..., then extra lanes."""
    base, _, lane = track.partition(" #")
    if base == "engine step":
        key: tuple = (0, 0, "")
    elif base.startswith("main "):
        key = (1, 0, _KIND_ORDER.get(base[5:], base))
    elif base.startswith("ubatch"):
        head, _, kind = base.partition(" ")
        key = (2, int(head[6:]) if head[6:].isdigit() else 0, _KIND_ORDER.get(kind, kind))
    else:
        key = (3, 0, base)
    return (*key, int(lane or 1))


def load_rank_spans(directory: str | Path) -> list[Span]:
    """All spans of the ``rank{r}.json`` files in ``directory`` (rank taken from the file name).

    Raises:
        FileNotFoundError: if there is none. ValueError: if one is not a Chrome trace.
    """
    files = sorted(
        (int(m.group(1)), path)
        for path in Path(directory).glob("rank*.json")
        if (m := _RANK_FILE.search(path.name))
    )
    if not files:
        raise FileNotFoundError(f"{directory}: no rank<r>.json timeline files")
    spans: list[Span] = []
    for rank, path in files:
        try:
            trace = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        spans += spans_from_chrome_trace(trace, rank=rank)
    return spans


def assign_lanes(spans: Sequence[Span]) -> dict[int, str]:
    """Track name per span index such that no two spans on one (rank, track) overlap: a span that
    overlaps the previous one on its lane goes to the first free lane ``<track> #k`` (k >= 2)."""
    lanes_of: dict[tuple[int, str], list[int]] = defaultdict(list)  # end_ns of each lane
    out: dict[int, str] = {}
    for i in sorted(range(len(spans)), key=lambda k: (spans[k].start_ns, spans[k].end_ns)):
        span = spans[i]
        lane_ends = lanes_of[(span.rank, span.track)]
        lane = next((k for k, end_ns in enumerate(lane_ends) if span.start_ns >= end_ns), None)
        if lane is None:
            lane = len(lane_ends)
            lane_ends.append(0)
        lane_ends[lane] = span.end_ns
        out[i] = span.track if lane == 0 else f"{span.track} #{lane + 1}"
    return out


def merge(spans: Sequence[Span]) -> dict:
    """One Chrome trace of all ranks: ``pid`` = rank, ``tid`` numbered per track in display order
    (named by ``thread_name``, ordered by ``thread_sort_index``), times from the earliest span."""
    lanes = assign_lanes(spans)
    origin_ns = min((s.start_ns for s in spans), default=0)
    events: list[dict] = []
    tids: dict[tuple[int, str], int] = {}
    for rank in sorted({s.rank for s in spans}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}
        )
        tracks = sorted({lanes[i] for i, s in enumerate(spans) if s.rank == rank}, key=_track_order)
        for tid, track in enumerate(tracks, 1):
            tids[(rank, track)] = tid
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": rank,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
    for i, s in enumerate(spans):
        # integer nanoseconds -> microseconds with 3 decimals: exact, so touching spans stay touching
        events.append(
            {
                "name": s.name,
                "cat": s.cat,
                "ph": "X",
                "ts": (s.start_ns - origin_ns) / 1000,
                "dur": (s.end_ns - s.start_ns) / 1000,
                "pid": s.rank,
                "tid": tids[(s.rank, lanes[i])],
                "args": s.args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def overlapping_events(trace: dict) -> list[tuple[dict, dict]]:
    """Pairs of complete events on one (pid, tid) that overlap (empty means Perfetto keeps all)."""
    by_track: dict[tuple, list[tuple[int, int, dict]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            start = round(e["ts"] * 1000)
            by_track[(e["pid"], e["tid"])].append((start, start + round(e["dur"] * 1000), e))
    bad = []
    for events in by_track.values():
        events.sort(key=lambda t: (t[0], t[1]))
        for (_, end_a, a), (start_b, _, b) in zip(events, events[1:], strict=False):
            if start_b < end_a:
                bad.append((a, b))
    return bad


def format_metrics_table(rows: Sequence[tuple[str, dict]]) -> str:
    """A fixed-width table of summary metrics, one row per label."""
    cols = [
        ("steps", "num_steps", "{:d}"),
        ("step ms", "step_ms", "{:.2f}"),
        ("C ms", "compute_ms", "{:.2f}"),
        ("M ms", "comm_ms", "{:.2f}"),
        ("exposed ms", "exposed_comm_ms", "{:.2f}"),
        ("overlap", "overlap_ratio", "{:.2f}"),
        ("ideal x", "ideal_speedup", "{:.2f}"),
        ("achieved x", "achieved_speedup", "{:.2f}"),
        ("of ideal", "fraction_of_ideal", "{:.2f}"),
        ("baton us", "baton_pass_us_median", "{:.1f}"),
    ]
    header = f"{'':<18}" + "".join(f"{name:>11}" for name, _, _ in cols)
    lines = [header]
    for label, values in rows:
        lines.append(
            f"{label:<18}" + "".join(f"{fmt.format(values[key]):>11}" for _, key, fmt in cols)
        )
    return "\n".join(lines)


def metric_rows(metrics: Sequence[StepMetrics]) -> list[tuple[str, dict]]:
    """Summary rows: per rank (all steps, microbatched steps) and over all ranks."""
    rows = []
    for rank in sorted({m.rank for m in metrics}):
        mine = [m for m in metrics if m.rank == rank]
        rows.append((f"rank {rank} all", summarize(mine).as_dict()))
        ubatched = [m for m in mine if m.is_ubatched]
        if ubatched:
            rows.append((f"rank {rank} DBO", summarize(ubatched).as_dict()))
    rows.append(("overall", summarize(metrics).as_dict()))
    return rows


def parse_steps(text: str) -> list[int]:
    """``"3"``, ``"2-5"`` or ``"1,4,7"`` -> step indices.

    Raises:
        ValueError: naming the malformed part.
    """
    steps: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            steps += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"--steps {text!r}: {part!r} is not N or N-M") from None
    return steps


def default_steps(metrics: Sequence[StepMetrics]) -> list[int]:
    """The microbatched step with the median step time (else the median step), as a 1-list."""
    candidates = [m for m in metrics if m.rank == metrics[0].rank and m.is_ubatched] or [
        m for m in metrics if m.rank == metrics[0].rank
    ]
    ordered = sorted(candidates, key=lambda m: m.step_ms)
    return [ordered[len(ordered) // 2].step] if ordered else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="folder with rank<r>.json files (--timeline-dir)")
    parser.add_argument("--output", default=None, help="merged trace (default DIR/timeline.json)")
    parser.add_argument("--png", default=None, help="picture (default DIR/timeline.png)")
    parser.add_argument(
        "--steps",
        default=None,
        help="steps to draw: N, N-M or N,M,... (default: a median DBO step)",
    )
    parser.add_argument("--per-step", action="store_true", help="also print every step's metrics")
    ns = parser.parse_args(argv)
    try:
        spans = load_rank_spans(ns.directory)
        metrics = step_metrics(spans)
        steps = parse_steps(ns.steps) if ns.steps else default_steps(metrics)
    except (OSError, ValueError) as e:
        print(f"launch.timeline: error: {e}", file=sys.stderr)
        return 2
    trace = merge(spans)
    bad = overlapping_events(trace)
    if bad:  # cannot happen after assign_lanes; checked because Perfetto would drop events
        print(
            f"launch.timeline: error: {len(bad)} overlapping events on one track", file=sys.stderr
        )
        return 1
    out = Path(ns.output or Path(ns.directory) / "timeline.json")
    out.write_text(json.dumps(trace), encoding="utf-8")
    num_tracks = len({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"})
    print(f"wrote {out}: {len(spans)} events on {num_tracks} tracks, no overlaps on any track")
    if ns.per_step:
        for m in metrics:
            print(json.dumps(m.as_dict()))
    print(format_metrics_table(metric_rows(metrics)))
    from launch.timeline_plot import plot_steps  # matplotlib only when drawing

    png = Path(ns.png or Path(ns.directory) / "timeline.png")
    plot_steps(spans, steps, png)
    print(f"wrote {png} (steps {steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
