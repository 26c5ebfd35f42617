"""A per-rank timeline of compute and communication spans, written as a Chrome trace.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev: one process per rank, one track
(a numbered ``tid`` with a ``thread_name``) per ubatch and kind, e.g. ``ubatch0 compute`` / ``ubatch0 comm``, so the overlap of one
ubatch's communication with the other's compute is visible. Times come from
``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux, so ranks on one host share the origin).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dbo.ubatch_context import dbo_current_ubatch_id, dbo_enabled


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineSpan:
    """One recorded span; times in ``perf_counter_ns()`` nanoseconds."""

    name: str
    cat: str
    start_ns: int
    end_ns: int
    track: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(
                f"span {self.name!r}: end_ns={self.end_ns} is before start_ns={self.start_ns}"
            )

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class TimelineRecorder:
    """Collects spans from any thread of one rank (appends are locked)."""

    def __init__(self, *, rank: int) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self._lock = threading.Lock()
        self._spans: list[TimelineSpan] = []

    def add_span(
        self,
        name: str,
        *,
        cat: str,
        start_ns: int,
        end_ns: int,
        track: str,
        args: dict | None = None,
    ) -> None:
        """Record ``[start_ns, end_ns]`` on ``track``. Raises ValueError if ``end_ns < start_ns``."""
        span = TimelineSpan(
            name=name, cat=cat, start_ns=start_ns, end_ns=end_ns, track=track, args=dict(args or {})
        )
        with self._lock:
            self._spans.append(span)

    def spans(self) -> list[TimelineSpan]:
        """A snapshot of the recorded spans, in recording order."""
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def chrome_trace(self) -> dict[str, Any]:
        """``{"traceEvents": [...]}``: complete events (``ph "X"``, ``ts``/``dur`` in µs,
        ``pid`` = rank, ``tid`` = the track's number, named by a ``thread_name`` metadata event)
        after the process/thread name metadata events. Track numbers are integers because
        Perfetto's JSON importer expects numeric thread ids."""
        spans = self.spans()
        events: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            }
        ]
        tids = {track: i for i, track in enumerate(sorted({span.track for span in spans}), 1)}
        for track, tid in tids.items():
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.rank,
                    "tid": tid,
                    "args": {"name": track},
                }
            )
        for span in spans:
            events.append(
                {
                    "name": span.name,
                    "cat": span.cat,
                    "ph": "X",
                    "ts": span.start_ns / 1000.0,
                    "dur": span.duration_ns / 1000.0,
                    "pid": self.rank,
                    "tid": tids[span.track],
                    "args": span.args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write ``chrome_trace()`` as JSON to ``path`` (the parent folder must exist)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)


_recorder: TimelineRecorder | None = None


def set_timeline_recorder(rec: TimelineRecorder | None) -> None:
    """Install (or with ``None`` remove) the process-wide recorder; ``launch/`` does this."""
    global _recorder
    _recorder = rec


def get_timeline_recorder() -> TimelineRecorder | None:
    return _recorder


def _track(kind: str) -> str:
    return f"ubatch{dbo_current_ubatch_id()} {kind}" if dbo_enabled() else f"main {kind}"


@contextmanager
def timeline_span(name: str, cat: str = "compute") -> Iterator[None]:
    """Record the enclosed block as a span on this thread's compute track (``ubatch{i} compute``
    with DBO on, else ``main compute``); a no-op without a recorder. Recorded even if it raises."""
    rec = _recorder
    if rec is None:
        yield
        return
    track = _track("compute")
    start_ns = time.perf_counter_ns()
    try:
        yield
    finally:
        rec.add_span(name, cat=cat, start_ns=start_ns, end_ns=time.perf_counter_ns(), track=track)


def record_comm_span(name: str, *, start_ns: int, end_ns: int, args: dict | None = None) -> None:
    """Record a communication span (e.g. a dispatch from issue to completion) on this thread's
    comm track (``ubatch{i} comm`` / ``main comm``); a no-op without a recorder. ``args`` (e.g.
    ``{"num_bytes": ...}``) is shown in the trace viewer."""
    rec = _recorder
    if rec is not None:
        rec.add_span(
            name, cat="comm", start_ns=start_ns, end_ns=end_ns, track=_track("comm"), args=args
        )
