"""A per-rank timeline of compute and communication spans, written as a Chrome trace.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev: one process per rank, one track
(a numbered ``tid`` with a ``thread_name``) per ubatch and kind, e.g. ``ubatch0 compute`` /
``ubatch0 comm``, so the overlap of one ubatch's communication with the other's compute is visible.
Times come from ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux, so ranks on one host share the
origin). With a device clock (``dbo.timeline.device_clock``), each compute span is also timed on
the device and lands, at the end of the engine step, on a ``gpu`` track (``ubatch0 gpu``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.forward_context import current_forward_context
from dbo.timeline.device_clock import DeviceClock
from dbo.timeline.tracks import POLICY_TRACK, STEP_TRACK, track_name, track_order
from dbo.ubatch_context import dbo_current_ubatch_id, dbo_enabled, set_baton_observer


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
    """Collects spans from any thread of one rank.

    Recording is cheap: a span is one tuple appended to a list (``list.append`` is atomic under
    the GIL, so no lock is taken); ``TimelineSpan`` objects are built only when read.

    With a ``device_clock``, compute spans also leave device marks, which
    ``resolve_device_spans`` turns into ``gpu`` spans (the engine calls it once per step).
    """

    def __init__(self, *, rank: int, device_clock: DeviceClock | None = None) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self.device_clock = device_clock
        self._raw: list[tuple] = []
        self._device_marks: list[tuple] = []  # (name, track, start mark, end mark, host start)

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
        """Record ``[start_ns, end_ns]`` on ``track``; ValueError if ``end_ns < start_ns``."""
        if end_ns < start_ns:
            raise ValueError(f"span {name!r}: end_ns={end_ns} is before start_ns={start_ns}")
        self._raw.append((name, cat, start_ns, end_ns, track, args))

    def add_device_marks(
        self, name: str, *, track: str, start_mark: object, end_mark: object, host_start_ns: int
    ) -> None:
        """Keep the device marks of a span launched at ``host_start_ns`` until the next
        ``resolve_device_spans``, which puts it on ``track``."""
        self._device_marks.append((name, track, start_mark, end_mark, host_start_ns))

    def resolve_device_spans(self) -> int:
        """Add the pending device marks as ``gpu`` spans, with ``args["queued_ms"]`` the time from
        the host's launch to the device's start; one ``DeviceClock.resolve`` (a host-device
        synchronisation). Call with no span open, as the end of an engine step is. Returns the
        number of spans added."""
        pending, self._device_marks = self._device_marks, []
        if not pending or self.device_clock is None:
            return 0
        times = self.device_clock.resolve([mark for p in pending for mark in p[2:4]])
        num_added = 0
        for i, (name, track, _, _, host_start_ns) in enumerate(pending):
            start_ns, end_ns = times[2 * i], times[2 * i + 1]
            if end_ns < start_ns:  # the block ended on another stream, which ran ahead: no span
                continue
            self.add_span(
                name,
                cat=CAT_GPU,
                start_ns=start_ns,
                end_ns=end_ns,
                track=track,
                args={"queued_ms": (start_ns - host_start_ns) / 1e6},
            )
            num_added += 1
        return num_added

    def spans(self, start: int = 0) -> list[TimelineSpan]:
        """A snapshot of the recorded spans from the ``start``-th on (see ``len``), in recording
        order."""
        raw = self._raw[start:]
        return [
            TimelineSpan(
                name=name, cat=cat, start_ns=start, end_ns=end, track=track, args=dict(args or {})
            )
            for name, cat, start, end, track, args in raw
        ]

    def __len__(self) -> int:
        return len(self._raw)

    def clear(self) -> None:
        self._raw = []

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
        tracks = sorted({span.track for span in spans}, key=track_order)
        tids = {track: i for i, track in enumerate(tracks, 1)}
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
        """Write ``chrome_trace()`` as JSON to ``path`` (the parent folder must exist), after
        resolving any pending device marks."""
        self.resolve_device_spans()
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)


# Span categories. Metrics count ``compute`` as compute and ``comm`` as communication; ``wait``
# (a ubatch blocked on its data), ``baton`` (a baton pass) and ``step`` (one engine step, the
# window of per-step metrics) are neither.
CAT_COMPUTE = "compute"
CAT_COMM = "comm"
CAT_WAIT = "wait"
CAT_BATON = "baton"
CAT_STEP = "step"
CAT_POLICY = "policy"  # an adaptive-DBO exploration step (neither compute nor communication)
# A combine from issue to taking its result, the window the shared experts overlap (comm track;
# neither compute nor communication in the metrics).
CAT_WINDOW = "window"
# A compute span as the device ran it (``gpu`` tracks); the metrics read these instead of the host
# ``compute`` spans in steps that have them.
CAT_GPU = "gpu"

_recorder: TimelineRecorder | None = None


def set_timeline_recorder(rec: TimelineRecorder | None) -> None:
    """Install (or with ``None`` remove) the process-wide recorder; ``launch/`` does this.

    While a recorder is installed, every baton pass between ubatch threads is recorded too.
    """
    global _recorder
    _recorder = rec
    set_baton_observer(_record_baton_pass if rec is not None else None)


def get_timeline_recorder() -> TimelineRecorder | None:
    return _recorder


def _track(kind: str) -> str:
    return track_name(kind, dbo_current_ubatch_id() if dbo_enabled() else None)


def torch_profiler_on() -> bool:
    """Whether a torch profiler is recording (a module-level flag torch sets while one is
    active: one attribute read, for hot paths)."""
    return torch.autograd.profiler._is_profiler_enabled


def is_timeline_active() -> bool:
    """Whether spans are being recorded (a recorder installed or a torch profiler running): a
    hot path may skip building a span when not."""
    return _recorder is not None or torch_profiler_on()


def set_timeline_layer(layer_idx: int | None) -> None:
    """Name this thread's following spans after decoder layer ``layer_idx`` (``layer3.experts``);
    ``None`` ends the layer. The layer is the current forward context's (each ubatch thread has
    its own); outside a forward this does nothing."""
    context = current_forward_context()
    if context is not None:
        context.layer = layer_idx


def timeline_layer() -> int | None:
    """This thread's current decoder layer (``set_timeline_layer``), None outside one."""
    context = current_forward_context()
    return None if context is None else context.layer


def span_name(name: str) -> str:
    """``name`` prefixed with this thread's current layer, e.g. ``layer3.attention``."""
    layer = timeline_layer()
    return name if layer is None else f"layer{layer}.{name}"


@contextmanager
def timeline_span(name: str, cat: str = CAT_COMPUTE, *, kind: str = "compute") -> Iterator[None]:
    """Record the enclosed block as a span named ``layer{L}.{name}`` (inside a layer) on this
    thread's ``kind`` track (``ubatch{i} compute`` with DBO on, else ``main compute``), and open a
    ``torch.profiler.record_function`` range of the same name while a torch profiler runs.
    A no-op without recorder and profiler. Recorded even if the block raises.

    The span's ``args["cpu_ms"]`` is the CPU time this thread spent in the block
    (``time.thread_time_ns``): wall time above it is time the thread was not running (preempted,
    blocked, or waiting for the GIL); CPU time itself growing means the same work ran slower.

    A compute span (``cat`` and ``kind`` compute) on a recorder with a device clock also marks the
    device's current stream before and after the block: the span as the device ran it, added on
    this thread's ``gpu`` track at the end of the step (``TimelineRecorder.resolve_device_spans``).
    """
    rec = _recorder
    if rec is None and not torch_profiler_on():
        yield
        return
    full_name = span_name(name)
    track = _track(kind)
    profiled = torch.profiler.record_function(full_name) if torch_profiler_on() else nullcontext()
    start_ns, cpu_start_ns = time.perf_counter_ns(), time.thread_time_ns()
    device_start = _device_start(rec, cat, kind)
    try:
        with profiled:
            yield
    finally:
        if rec is not None:
            if device_start is not None:
                _device_end(rec, full_name, device_start, start_ns)
            cpu_ms = (time.thread_time_ns() - cpu_start_ns) / 1e6
            rec.add_span(
                full_name,
                cat=cat,
                start_ns=start_ns,
                end_ns=time.perf_counter_ns(),
                track=track,
                args={"cpu_ms": cpu_ms},
            )


def _device_start(rec: TimelineRecorder | None, cat: str, kind: str) -> tuple | None:
    """(this thread's ``gpu`` track, a device mark) at the start of a compute span on a recorder
    with a device clock; None otherwise or when the clock cannot mark now."""
    clock = rec.device_clock if rec is not None else None
    if clock is None or cat != CAT_COMPUTE or kind != "compute":
        return None
    mark = clock.mark()
    return None if mark is None else (_track("gpu"), mark)


def _device_end(rec: TimelineRecorder, name: str, device_start: tuple, host_start_ns: int) -> None:
    track, start_mark = device_start
    end_mark = rec.device_clock.mark()
    if end_mark is not None:
        rec.add_device_marks(
            name, track=track, start_mark=start_mark, end_mark=end_mark, host_start_ns=host_start_ns
        )


def blocking_comm_span(name: str) -> AbstractContextManager[None]:
    """A blocking collective (e.g. the DP vote) as a ``comm`` span on this thread's comm track."""
    return timeline_span(name, CAT_COMM, kind="comm")


def record_span(
    name: str, *, cat: str, start_ns: int, end_ns: int, kind: str, args: dict | None = None
) -> None:
    """Record an already-measured span (named after the current layer) on this thread's ``kind``
    track; a no-op without a recorder. Zero-length spans are dropped."""
    rec = _recorder
    if rec is not None and end_ns > start_ns:
        rec.add_span(
            span_name(name),
            cat=cat,
            start_ns=start_ns,
            end_ns=end_ns,
            track=_track(kind),
            args=args,
        )


def record_comm_span(name: str, *, start_ns: int, end_ns: int, args: dict | None = None) -> None:
    """Record a communication span (e.g. a dispatch from issue to completion) on this thread's
    comm track (``ubatch{i} comm`` / ``main comm``); a no-op without a recorder. ``args`` (e.g.
    ``{"num_bytes": ...}``) is shown in the trace viewer."""
    rec = _recorder
    if rec is not None:
        rec.add_span(
            span_name(name),
            cat=CAT_COMM,
            start_ns=start_ns,
            end_ns=end_ns,
            track=_track("comm"),
            args=args,
        )


def record_policy_span(name: str, *, start_ns: int, end_ns: int, args: dict | None = None) -> None:
    """Mark an adaptive-DBO step (e.g. ``explore on``) on the ``dbo policy`` track; a no-op
    without a recorder."""
    rec = _recorder
    if rec is not None and end_ns >= start_ns:
        rec.add_span(
            name, cat=CAT_POLICY, start_ns=start_ns, end_ns=end_ns, track=POLICY_TRACK, args=args
        )


def _record_baton_pass(ubatch_id: int, handed_at_ns: int, woke_at_ns: int) -> None:
    # called by the receiving ubatch thread right after it got the baton
    rec = _recorder
    if rec is not None:
        rec.add_span(
            "baton pass",
            cat=CAT_BATON,
            start_ns=handed_at_ns,
            end_ns=woke_at_ns,
            track=track_name("compute", ubatch_id),
        )


@contextmanager
def timeline_step(step_index: int, **args: Any) -> Iterator[dict[str, Any]]:
    """Record one engine step on the ``engine step`` track (the window of per-step metrics) and as
    a ``torch.profiler.record_function`` range ``step``. Yields the span's args dict (holding
    ``step`` and ``args``), which the caller may fill in (e.g. ``num_tokens``) before leaving.

    On leaving, with every span of the step enqueued, the step's device marks are resolved (one
    host-device synchronisation, after the step's end time is taken)."""
    step_args = {"step": step_index, **args}
    rec = _recorder
    if rec is None and not torch_profiler_on():
        yield step_args
        return
    profiled = torch.profiler.record_function("step") if torch_profiler_on() else nullcontext()
    start_ns = time.perf_counter_ns()
    try:
        with profiled:
            yield step_args
    finally:
        if rec is not None:
            rec.add_span(
                "step",
                cat=CAT_STEP,
                start_ns=start_ns,
                end_ns=time.perf_counter_ns(),
                track=STEP_TRACK,
                args=step_args,
            )
    if rec is not None:  # not after a raise: a failed device would mask the error
        rec.resolve_device_spans()
