"""Overlap timeline: the recorder the engine writes spans to (``recorder``), the clock that times
its compute spans on a device (``device_clock``), the spans of the MoE transfers recorded around
their comm handles (``transfers``), the track names it writes and the readers sort
by (``tracks``), merging the ranks' spans into one Chrome trace (``trace``), overlap metrics
(``metrics``) and a PNG (``plot``)."""

from dbo.timeline.device_clock import CudaDeviceClock, DeviceClock
from dbo.timeline.recorder import (
    TimelineRecorder,
    TimelineSpan,
    get_timeline_recorder,
    record_comm_span,
    set_timeline_recorder,
    timeline_span,
)
from dbo.timeline.transfers import RecordedTransfer, record_transfer, transfer_result

__all__ = [
    "CudaDeviceClock",
    "DeviceClock",
    "RecordedTransfer",
    "TimelineRecorder",
    "TimelineSpan",
    "get_timeline_recorder",
    "record_comm_span",
    "record_transfer",
    "set_timeline_recorder",
    "timeline_span",
    "transfer_result",
]
