"""The GPU half of the ubatch protocol (vLLM's ``UBatchContext`` on CUDA): ``UBatchStreams``, one
ubatch's compute and comm streams and the events that order its kernels across baton passes, and
``make_ubatch_streams``. Why and how: docs/dbo.md, "Streams and events on a GPU"."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class UBatchStreams:
    """One ubatch's CUDA streams and the event it records before each CPU yield.

    Attributes:
        compute_stream: where attention, router and experts run (shared by the ubatches).
        comm_stream: this ubatch's stream for dispatch / combine.
        yield_event: recorded on the current stream before this ubatch hands the baton on.
        switch_event: recorded on the stream this ubatch leaves when it switches streams.
    """

    compute_stream: torch.cuda.Stream
    comm_stream: torch.cuda.Stream
    yield_event: torch.cuda.Event
    switch_event: torch.cuda.Event

    def enter(self) -> None:
        """Make the stream's device and the compute stream this thread's current ones (both
        are per thread: a new ubatch thread starts on device 0)."""
        torch.cuda.set_device(self.compute_stream.device)
        torch.cuda.set_stream(self.compute_stream)

    def record_before_yield(self) -> torch.cuda.Event:
        """Record ``yield_event`` on the current stream (all work enqueued so far); return it."""
        self.yield_event.record(torch.cuda.current_stream())
        return self.yield_event

    @staticmethod
    def wait_after_yield(event: torch.cuda.Event | None) -> None:
        """Make the current stream wait for the work the previous baton owner had enqueued."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def switch_to(self, stream: torch.cuda.Stream) -> None:
        """Continue on ``stream`` after everything enqueued on the current one (no host sync)."""
        current = torch.cuda.current_stream()
        if current == stream:
            return
        self.switch_event.record(current)
        stream.wait_event(self.switch_event)
        torch.cuda.set_stream(stream)


def make_ubatch_streams(num_ubatches: int, device: torch.device) -> list[UBatchStreams]:
    """Streams for ``num_ubatches`` ubatches on CUDA ``device``: the caller's current stream as the
    shared compute stream, a new comm stream each.

    Raises:
        ValueError: if CUDA is unavailable, or (torch's) if ``device`` is not a CUDA device (the
            platform asks only for its CUDA tensors: ``CudaPlatform.make_ubatch_streams``).
    """
    if not torch.cuda.is_available():
        raise ValueError(f"ubatch streams need an available CUDA device, got {device}")
    compute_stream = torch.cuda.current_stream(device)  # ValueError on a non-CUDA device
    return [
        UBatchStreams(
            compute_stream=compute_stream,
            comm_stream=torch.cuda.Stream(device=device),
            yield_event=torch.cuda.Event(),
            switch_event=torch.cuda.Event(),
        )
        for _ in range(num_ubatches)
    ]
