"""Overlap timeline: the recorder the engine writes spans to (``recorder``), the track names it
writes and the readers sort by (``tracks``), merging the ranks' spans into one Chrome trace
(``trace``), overlap metrics (``metrics``) and a PNG (``plot``)."""

from dbo.timeline.recorder import (
    TimelineRecorder,
    TimelineSpan,
    get_timeline_recorder,
    record_comm_span,
    set_timeline_recorder,
    timeline_span,
)

__all__ = [
    "TimelineRecorder",
    "TimelineSpan",
    "get_timeline_recorder",
    "record_comm_span",
    "set_timeline_recorder",
    "timeline_span",
]
