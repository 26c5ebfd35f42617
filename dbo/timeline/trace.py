"""Merge per-rank timeline spans into one Chrome trace (a process per rank, a track per ubatch and
kind, time 0 = the earliest event), with each track free of overlapping events."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from dbo.timeline.metrics import Span, spans_from_chrome_trace
from dbo.timeline.tracks import lane_name, track_order

_RANK_FILE = re.compile(r"rank(\d+)\.json$")


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
        out[i] = lane_name(span.track, lane)
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
        tracks = sorted({lanes[i] for i, s in enumerate(spans) if s.rank == rank}, key=track_order)
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
        # integer ns -> µs with 3 decimals: exact, so touching spans stay touching
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
