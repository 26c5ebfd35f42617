"""The emulated link: parsing, the deadline arithmetic, and real collectives delayed as specified."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from distributed import (
    BACKENDS,
    CollectiveHandle,
    EmulatedLink,
    LinkSpec,
    init_distributed,
    make_all2all_backend,
)
from tests.helpers.distributed import run_distributed


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
    handle = CollectiveHandle(
        op="test", rank=0, timeout=datetime.timedelta(seconds=5), work=None,
        finalize=lambda: 7, issued_at_ns=issued, num_bytes=0,
        link_deadline_ns=issued + 30_000_000,
    )  # fmt: skip
    assert not handle.is_completed()
    assert handle.wait() == 7
    assert time.perf_counter_ns() >= issued + 30_000_000
    assert handle.completed_at_ns >= issued + 30_000_000 and handle.is_completed()


LATENCY_US, GBPS = 3_000.0, 0.08  # 3 ms, 10 MB/s: ~0.4 ms per 4 KiB


def _delayed_rank(rank: int, world_size: int) -> list[dict]:
    groups = init_distributed(data_parallel_size=world_size, enable_expert_parallel=True)
    spec = LinkSpec(latency_us=LATENCY_US, gbps=GBPS)
    out = []
    for name in BACKENDS:  # DeepEP's protocols bill their transfers on the same link
        backend = make_all2all_backend(
            name, ep_group=groups.ep_group, ep_rank=groups.ep_rank, ep_size=groups.ep_size,
            num_experts=4, timeout=groups.timeout, link=EmulatedLink(spec),
        )  # fmt: skip
        x = torch.randn(64, 32)
        ids = torch.tensor([[0, 3]] * 64)  # every token goes to both ranks
        dispatch = backend.dispatch(x, ids, torch.ones(64, 2), async_op=True)
        result = dispatch.wait()
        combine = backend.combine(result.hidden_states, result.metadata, async_op=True)
        combine.wait()
        for handle in (dispatch, combine):
            out.append({
                "backend": name,
                "elapsed_ns": handle.completed_at_ns - handle.issued_at_ns,
                "min_ns": spec.latency_ns + spec.transfer_ns(handle.num_bytes),
                "notify_ns": None if handle.notify_ns is None
                else handle.notify_ns[1] - handle.notify_ns[0],
            })  # fmt: skip
    return out


@pytest.mark.slow
def test_collectives_complete_after_latency_plus_bytes_over_bandwidth():
    for per_rank in run_distributed(_delayed_rank, 2, timeout_s=60):
        for row in per_rank:
            assert row["elapsed_ns"] >= row["min_ns"] > LATENCY_US * 1000, row
            # the link, not gloo, sets the pace (gloo over loopback moves these bytes in < 1 ms)
            assert row["elapsed_ns"] < row["min_ns"] + 200_000_000, row
            if row["notify_ns"] is not None:  # the blocking count exchange pays the latency too
                assert row["notify_ns"] >= LATENCY_US * 1000, row
