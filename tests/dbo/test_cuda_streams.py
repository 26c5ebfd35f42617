"""The GPU half of the ubatch protocol (``dbo.cuda_streams``): streams per ubatch and an event
recorded before each hand-over that the next owner's stream waits on. Needs CUDA; skipped
without it."""

from __future__ import annotations

import threading

import pytest
import torch

from dbo import dbo_switch_to_comm, dbo_switch_to_compute, dbo_yield, make_ubatch_contexts
from dbo.cuda_streams import make_ubatch_streams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(contexts, fn):
    errors: list = []

    def body(ctx):
        try:
            with ctx:
                fn(ctx)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(ctx,)) for ctx in contexts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors


def test_contexts_carry_streams_and_start_on_the_compute_stream():
    contexts = make_ubatch_contexts(
        2, timeout_s=10, streams=make_ubatch_streams(2, torch.device("cuda"))
    )
    streams = [ctx.streams for ctx in contexts]
    assert all(s is not None for s in streams)
    assert streams[0].compute_stream == streams[1].compute_stream
    assert streams[0].comm_stream != streams[1].comm_stream
    seen = {}

    def fn(ctx):
        seen[ctx.id] = torch.cuda.current_stream() == ctx.streams.compute_stream
        dbo_switch_to_comm()
        seen[ctx.id, "comm"] = torch.cuda.current_stream() == ctx.streams.comm_stream
        dbo_switch_to_compute()

    _run(contexts, fn)
    assert all(seen.values()), seen
    assert make_ubatch_contexts(2, timeout_s=1)[0].streams is None  # CPU: no streams


def test_work_enqueued_before_a_yield_is_visible_to_the_next_owner():
    """Ubatch 0 writes on its comm stream behind a long kernel and yields without syncing; ubatch
    1's reads, enqueued after the baton pass, must see the write (the hand-over event orders
    them)."""
    contexts = make_ubatch_contexts(
        2, timeout_s=10, streams=make_ubatch_streams(2, torch.device("cuda"))
    )
    data = torch.zeros(1 << 20, device="cuda")
    result = {}

    def fn(ctx):
        if ctx.id == 0:
            dbo_switch_to_comm()
            torch.cuda._sleep(100_000_000)  # keep the stream busy for a while (~50 ms)
            data.fill_(1.0)
            dbo_yield()
            dbo_switch_to_compute()
        else:
            result["sum"] = data.sum()  # enqueued on the compute stream after the baton pass
            dbo_yield()

    _run(contexts, fn)
    torch.cuda.synchronize()
    assert result["sum"].item() == data.numel()
