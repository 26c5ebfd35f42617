"""The emulated link: parsing, the deadline arithmetic, and ``with_link`` on every
registered backend (its transfers and its blocking count exchange delayed as specified)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from distributed import (
    BACKENDS,
    CollectiveHandle,
    CommTiming,
    EmulatedLink,
    LinkDelayedHandle,
    LinkSpec,
    init_distributed,
    make_prepare_finalize,
)
from distributed.all2all.deepep_buffer import DEEPEP_KERNELS
from tests.helpers.cpu_kernels import needs_compiler
from tests.helpers.distributed import platform_communicators, run_distributed


def test_parse_and_validation():
    assert LinkSpec.parse("gbps=2.5, latency_us=40") == LinkSpec(latency_us=40, gbps=2.5)
    for bad, message in (
        ("latency_us=1", r"missing \['gbps'\]"),
        ("latency_us=1,gbps=x", "gbps='x' is not a number"),
        ("latency=1,gbps=1", "got part 'latency=1'"),
        ("latency_us=1,gbps=0", "gbps must be > 0"),
        ("latency_us=-1,gbps=1", "latency_us must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            LinkSpec.parse(bad)


def test_transfers_share_the_link_one_after_the_other():
    spec = LinkSpec(latency_us=100, gbps=1)  # 125_000 bytes take 1 ms
    assert spec.transfer_ns(125_000) == 1_000_000
    link = EmulatedLink(spec)
    assert link.deadline_ns(0, 125_000) == 1_100_000
    assert link.deadline_ns(0, 125_000) == 2_100_000  # queued behind the first
    assert link.deadline_ns(10_000_000, 0) == 10_100_000  # idle link: latency only


def test_handle_completes_no_earlier_than_the_deadline():
    issued = time.perf_counter_ns()
    inner = CollectiveHandle(
        op="test",
        rank=0,
        timeout=datetime.timedelta(seconds=5),
        work=None,
        finalize=lambda: 7,
        timing=CommTiming(issued_at_ns=issued, num_bytes=0),
    )
    handle = LinkDelayedHandle(inner, issued + 30_000_000)
    assert not handle.is_completed()
    assert handle.wait() == 7
    assert time.perf_counter_ns() >= issued + 30_000_000
    assert handle.timing.completed_at_ns >= issued + 30_000_000 and handle.is_completed()
    # the receive-side work ran after the deadline, not during the emulated transfer
    assert handle.timing.finish_ns[0] >= issued + 30_000_000
    # the payload's own arrival is the inner handle's completion (here stamped by its wait, as
    # no collective offers a future), which the planner's calibration reads
    assert handle.timing.payload_at_ns == inner.timing.completed_at_ns
    assert issued <= handle.timing.payload_at_ns <= handle.timing.completed_at_ns
    assert inner.timing.payload_at_ns is None  # the inner handle knows no emulated link


class RecordingLink(EmulatedLink):
    """An ``EmulatedLink`` that logs every booking ``(issued_at_ns, num_bytes, deadline_ns)``."""

    def __init__(self, spec: LinkSpec) -> None:
        super().__init__(spec)
        self.bookings: list[tuple[int, int, int]] = []

    def deadline_ns(self, issued_at_ns: int, num_bytes: int) -> int:
        deadline_ns = super().deadline_ns(issued_at_ns, num_bytes)
        self.bookings.append((issued_at_ns, num_bytes, deadline_ns))
        return deadline_ns


SLOW = LinkSpec(latency_us=20_000.0, gbps=1.0)  # 20 ms: far above a local copy's time


def _local_backend(name: str):
    """``name`` on one rank (local copies, no process group)."""
    return make_prepare_finalize(
        name,
        ep_group=None,
        ep_rank=0,
        ep_size=1,
        num_experts=4,
        timeout=datetime.timedelta(seconds=30),
    )


def _wrapped(name: str, link: EmulatedLink):
    return _local_backend(name).with_link(link)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_wrapper_delays_every_registered_backend(name):
    """One rank (local copies): every transfer and count exchange books the link once, in issue
    order, and completes no earlier than its deadline; the payload leaves after the exchange's
    deadline; results equal the bare backend's."""
    link = RecordingLink(SLOW)
    backend = _wrapped(name, link)
    bare = _local_backend(name)
    assert (backend.name, backend.activation_format) == (bare.name, bare.activation_format)
    assert backend.blocks_under_dbo == bare.blocks_under_dbo
    x, ids = torch.randn(6, 8), torch.tensor([[0, 3], [1, 2]] * 3)
    dispatch = backend.dispatch(x, ids, torch.ones(6, 2), async_op=True)
    assert not dispatch.is_completed()  # the link's deadline is 20 ms away
    result = dispatch.wait()
    combine = backend.combine(result.hidden_states, result.metadata)  # synchronous: complete
    assert combine.is_completed()
    # the round trip equals the bare backend's (rows past a low-latency expert's count are
    # unspecified, so compare after combine, which ignores them)
    reference = bare.dispatch(x, ids, torch.ones(6, 2)).wait()
    assert torch.equal(
        combine.wait(), bare.combine(reference.hidden_states, reference.metadata).wait()
    )
    notify = dispatch.timing.notify_ns
    expected = [dispatch.timing.issued_at_ns, combine.timing.issued_at_ns]
    if notify is not None:  # the count exchange: booked first, the payload after its deadline
        expected.insert(0, notify[0])
        assert notify[1] >= link.bookings[0][2] and dispatch.timing.issued_at_ns >= notify[1]
    assert [issued for issued, _, _ in link.bookings] == expected
    for handle, (_, num_bytes, deadline_ns) in zip(
        (dispatch, combine), link.bookings[-2:], strict=True
    ):
        timing = handle.timing
        assert isinstance(timing, CommTiming) and num_bytes == timing.num_link_bytes == 0
        assert timing.completed_at_ns >= deadline_ns >= timing.issued_at_ns + SLOW.latency_ns
        assert timing.finish_ns[0] >= deadline_ns


def test_wrapper_bills_the_larger_direction():
    link = RecordingLink(LinkSpec(latency_us=0.0, gbps=8.0))  # 1 ns per byte
    timing = CommTiming(issued_at_ns=time.perf_counter_ns(), num_bytes=100, num_recv_bytes=300)

    class _Issued:
        def __init__(self):
            self.timing = timing

    delayed = link.delayed(_Issued())
    assert link.bookings == [(timing.issued_at_ns, 300, timing.issued_at_ns + 300)]
    assert delayed.deadline_ns == timing.issued_at_ns + 300


def test_wrapper_refuses_deepep_kernels():
    inner = _local_backend("all_to_all")
    inner.implementation = DEEPEP_KERNELS
    with pytest.raises(ValueError, match="--emulate-link applies to the torch.distributed"):
        inner.with_link(EmulatedLink(SLOW))


LATENCY_US, GBPS = 3_000.0, 0.08  # 3 ms, 10 MB/s: ~0.4 ms per 4 KiB


def _delayed_rank(rank: int, world_size: int, transport: str) -> list[dict]:
    groups = init_distributed(
        data_parallel_size=world_size,
        enable_expert_parallel=True,
        make_communicator=platform_communicators(300) if transport == "shm" else None,
    )
    assert groups.ep_comm.backend == transport
    spec = LinkSpec(latency_us=LATENCY_US, gbps=GBPS)
    out = []
    for name in BACKENDS:  # DeepEP's protocols bill their transfers on the same link
        inner = make_prepare_finalize(
            name,
            ep_group=groups.ep_comm,
            ep_rank=groups.ep_rank,
            ep_size=groups.ep_size,
            num_experts=4,
            timeout=groups.timeout,
        )
        link = RecordingLink(spec)
        backend = inner.with_link(link)
        x = torch.randn(64, 32)
        ids = torch.tensor([[0, 3]] * 64)  # every token goes to both ranks
        dispatch = backend.dispatch(x, ids, torch.ones(64, 2), async_op=True)
        result = dispatch.wait()
        combine = backend.combine(result.hidden_states, result.metadata, async_op=True)
        combine.wait()
        billed = {issued: num_bytes for issued, num_bytes, _ in link.bookings}
        for handle in (dispatch, combine):
            timing = handle.timing
            notify = timing.notify_ns
            out.append(
                {
                    "backend": name,
                    "elapsed_ns": timing.completed_at_ns - timing.issued_at_ns,
                    "min_ns": spec.latency_ns + spec.transfer_ns(timing.num_link_bytes),
                    "billed": billed[timing.issued_at_ns] == timing.num_link_bytes > 0,
                    "notify_ns": None if notify is None else notify[1] - notify[0],
                }
            )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["gloo", pytest.param("shm", marks=needs_compiler)])
def test_collectives_complete_after_latency_plus_bytes_over_bandwidth(transport):
    """The link delays gloo's and shared memory's transfers alike."""
    for per_rank in run_distributed(_delayed_rank, 2, transport, timeout_s=60):
        for row in per_rank:
            assert row["billed"], row
            assert row["elapsed_ns"] >= row["min_ns"] > LATENCY_US * 1000, row
            # the link, not gloo, sets the pace (gloo over loopback moves these bytes in < 1 ms)
            assert row["elapsed_ns"] < row["min_ns"] + 200_000_000, row
            if row["notify_ns"] is not None:  # the blocking count exchange pays the latency too
                assert row["notify_ns"] >= LATENCY_US * 1000, row
