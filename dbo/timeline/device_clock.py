"""Device-timed spans: when a device ran the work a host span enqueued.

On CUDA kernels run asynchronously, so a host ``compute`` span only measures how long the host took
to launch them. A ``DeviceClock`` marks the current stream at a span's start and end and, once the
step's work is enqueued, turns the marks into host ``perf_counter_ns`` times. The platform hands
one out (``Platform.device_clock``); the recorder only needs this protocol.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch


class DeviceClock(Protocol):
    """Marks on the device's current stream, resolved to host ``perf_counter_ns`` times."""

    def mark(self) -> object | None:
        """Record a timing mark on the current stream; an opaque handle, or None where no mark
        can be recorded (e.g. while a CUDA graph is being captured)."""

    def resolve(self, marks: Sequence[object]) -> list[int]:
        """The ``perf_counter_ns`` time at which each of ``marks`` (handles of ``mark``, none
        None) completed on the device, in order. Blocks until they have."""


class CudaDeviceClock:
    """``torch.cuda.Event(enable_timing=True)`` marks, timed against a reference event.

    The reference is recorded on an idle device right after a synchronize; its host time is taken
    once it has completed, so it is at most a few µs late and a resolved time is never before the
    host launched the work. It is re-recorded after every ``resolve``: ``elapsed_time`` is a
    float32 count of ms (its resolution coarsens as the distance grows) and the GPU's clock drifts
    from the host's, so each step is timed from a fresh reference.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reference = torch.cuda.Event(enable_timing=True)
        self._reference_ns = 0
        torch.cuda.synchronize(self.device)  # host-device sync: the reference needs an idle device
        self._anchor()

    def _anchor(self) -> None:
        # called with the device idle (right after a synchronize)
        with torch.cuda.device(self.device):
            self._reference.record()
        self._reference.synchronize()  # blocking wait: a few µs on the idle device
        self._reference_ns = time.perf_counter_ns()

    def mark(self) -> torch.cuda.Event | None:
        if torch.cuda.is_current_stream_capturing():
            return None  # a captured record would not be a timing mark at replay
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, marks: Sequence[torch.cuda.Event]) -> list[int]:
        torch.cuda.synchronize(self.device)  # host-device sync: once per step, every mark done
        times = [
            self._reference_ns + round(self._reference.elapsed_time(event) * 1e6) for event in marks
        ]
        self._anchor()
        return times
