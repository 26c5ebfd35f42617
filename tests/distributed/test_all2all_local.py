"""Single-process checks of the all-to-all backends: packing, construction, bad inputs, a
one-rank round trip, and the low-latency buffer's hook and capacity (the multi-rank cases are in
``test_all2all.py``)."""

from __future__ import annotations

import datetime

import pytest
import torch

from distributed import (
    BACKENDS,
    AllGatherReduceScatterPrepareAndFinalize,
    AllToAllPrepareAndFinalize,
    CommTiming,
    DispatchResult,
    FusedMoEActivationFormat,
    StandardDispatchMetadata,
    make_prepare_finalize,
)
from distributed.all2all.base import DEBUG_CHECKS_ENV
from distributed.all2all.token_packing import (
    RowLayout,
    localize_topk,
    pack_rows,
    token_rank_mask,
    unpack_rows,
)
from tests.helpers.all2all import (
    apply_experts,
    assert_close,
    expert_scales,
    make_inputs,
    run_experts,
)


def test_token_rank_mask_hand_worked():
    topk_ids = torch.tensor([[0, 5], [2, 3], [-1, 7], [-1, -1]])
    mask = token_rank_mask(topk_ids, num_local_experts=2, ep_size=4)
    expected = [[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert mask.tolist() == [[bool(v) for v in row] for row in expected]
    local_ids, local_w = localize_topk(topk_ids, torch.ones(4, 2), 1, num_local_experts=2)
    assert local_ids.tolist() == [[-1, -1], [0, 1], [-1, -1], [-1, -1]]
    assert local_w.tolist() == [[0, 0], [1, 1], [0, 0], [0, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(("hidden_size", "num_topk"), [(3, 3), (5, 1), (8, 2)])
def test_pack_unpack_round_trip_is_exact(dtype, hidden_size, num_topk):
    layout = RowLayout(hidden_size=hidden_size, num_topk=num_topk, dtype=dtype)
    assert layout.row_bytes % 8 == 0
    x = torch.randn(4, hidden_size).to(dtype)
    ids = torch.randint(-1, 9, (4, num_topk))
    w = torch.rand(4, num_topk)
    packed = pack_rows(x, ids, w, layout, num_rows=6)
    assert packed.shape == (6, layout.row_bytes) and packed.dtype == torch.uint8
    got_ids, got_w, got_x = unpack_rows(packed, layout)
    assert torch.equal(got_ids[:4], ids) and torch.equal(got_w[:4], w)
    assert torch.equal(got_x[:4], x) and not got_x[4:].any()


def _local_backend(name: str = "all_to_all", num_experts: int = 4, **options):
    """A one-rank backend (no process group); ``options``: the class's extra options."""
    return make_prepare_finalize(
        name,
        ep_group=None,
        ep_rank=0,
        ep_size=1,
        num_experts=num_experts,
        timeout=datetime.timedelta(seconds=5),
        **options,
    )


def test_make_prepare_finalize_names_accepted_backends():
    assert list(BACKENDS) == [
        "all_to_all",
        "allgather_reducescatter",
        "deepep_high_throughput",
        "deepep_low_latency",
    ]
    assert BACKENDS["all_to_all"] is AllToAllPrepareAndFinalize
    assert BACKENDS["allgather_reducescatter"] is AllGatherReduceScatterPrepareAndFinalize
    with pytest.raises(ValueError, match=r"unknown all2all backend 'deepep'.*'all_to_all'"):
        make_prepare_finalize("deepep")


def test_backend_rejects_bad_construction():
    timeout = datetime.timedelta(seconds=1)
    with pytest.raises(
        ValueError, match=r"num_experts \(6\) must be a positive multiple of ep_size \(4\)"
    ):
        AllToAllPrepareAndFinalize(
            ep_group=None, ep_rank=0, ep_size=4, num_experts=6, timeout=timeout
        )
    with pytest.raises(ValueError, match=r"ep_group is required when ep_size > 1"):
        AllToAllPrepareAndFinalize(
            ep_group=None, ep_rank=0, ep_size=2, num_experts=4, timeout=timeout
        )
    with pytest.raises(ValueError, match=r"ep_rank in \[0, 2\), got 2"):
        AllToAllPrepareAndFinalize(
            ep_group=None, ep_rank=2, ep_size=2, num_experts=4, timeout=timeout
        )


@pytest.mark.parametrize("name", list(BACKENDS))
def test_dispatch_and_combine_reject_bad_inputs(name, monkeypatch):
    x, ids, w = torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    unchecked = _local_backend(name)
    assert not unchecked.debug_checks and not unchecked.check_topk_ids  # per call: debug only
    assert _local_backend(name, check_topk_ids=True).check_topk_ids
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    backend = _local_backend(name)
    for checking in (backend, _local_backend(name, check_topk_ids=True)):
        assert checking.debug_checks and checking.check_topk_ids
        expected = r"topk_ids must be in \[0, 4\) or -1, got values in \[4, 4\]"
        with pytest.raises(ValueError, match=expected):
            checking.dispatch(x, ids + 4, w)
    with pytest.raises(TypeError, match=r"topk_ids must be int64"):
        backend.dispatch(x, ids.int(), w)
    with pytest.raises(TypeError, match=r"hidden_states must be a 2-D floating tensor"):
        backend.dispatch(x.long(), ids, w)
    result = backend.dispatch(x, ids, w).wait()
    expected = (
        r"\[3, 4\]"
        if backend.activation_format is FusedMoEActivationFormat.Standard
        else r"\[4, 128, 4\]"
    )
    with pytest.raises(ValueError, match=rf"expert_output must be floating {expected}"):
        backend.combine(torch.zeros(2, 4), result.metadata)
    other = _local_backend(next(n for n in BACKENDS if n != name))
    with pytest.raises(ValueError, match=r"metadata must come from dispatch on this"):
        other.combine(torch.zeros(3, 4), result.metadata)


def test_debug_checks_check_a_dispatch_result_when_it_is_made(monkeypatch):
    metadata = StandardDispatchMetadata(
        backend="all_to_all",
        ep_rank=0,
        num_tokens=3,
        hidden_size=4,
        dtype=torch.float32,
        num_recv_tokens=3,
    )
    ids = torch.zeros(3, 2, dtype=torch.long)
    short = DispatchResult(
        hidden_states=torch.zeros(2, 4), topk_ids=ids, topk_weights=ids.float(), metadata=metadata
    )
    timing = CommTiming(issued_at_ns=0, num_bytes=0)
    # a pattern's handle (the base's ``_handle``) over a finalize that makes the wrong rows
    unchecked = _local_backend()._handle((None, None), lambda: short, op="t", timing=timing)
    assert unchecked.wait() is short
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    handle = _local_backend()._handle((None, None), lambda: short, op="t", timing=timing)
    with pytest.raises(ValueError, match=r"hidden_states must be \[3, 4\], got \[2, 4\]"):
        handle.wait()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_single_rank_backend_round_trip(name):
    backend = _local_backend(name, num_experts=4)
    x, ids, w = make_inputs(3, 0, 6, 2, 4, torch.float32)
    scales = expert_scales(3, 4)
    result = backend.dispatch(x, ids, w, async_op=True).wait()
    out = backend.combine(run_experts(result, scales, 0), result.metadata).wait()
    assert_close(out, apply_experts(x, ids, w, scales, 0), atol=1e-6, rtol=1e-6)


def _local_buffer(capacity: int):
    from distributed.all2all.deepep_buffer import TorchDistributedBuffer

    return TorchDistributedBuffer(
        None,
        rank=0,
        num_ranks=1,
        timeout=datetime.timedelta(seconds=5),
        num_max_dispatch_tokens_per_rank=capacity,
    )


def test_low_latency_hook_completes_the_receive():
    """DeepEP's return_recv_hook=True: the call only issues; recv_x / recv_count hold after
    hook()."""
    buffer = _local_buffer(4)
    x = torch.arange(12.0).view(3, 4)
    ids = torch.tensor([[1, 0], [1, -1], [0, 1]])
    recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
        x, ids, 4, 2, use_fp8=False, return_recv_hook=True
    )
    assert recv_count.tolist() == [0, 0] and not handle.is_received.is_set()
    hook()
    assert recv_count.tolist() == [2, 3]
    assert torch.equal(recv_x[0, :2], x[[0, 2]]) and torch.equal(recv_x[1, :3], x)
    hook()  # idempotent
    weights = torch.tensor([[0.5, 0.25], [1.0, 0.0], [2.0, 3.0]])
    combined, _, hook = buffer.low_latency_combine(
        2 * recv_x, ids, weights, handle, return_recv_hook=True
    )
    hook()
    expected = 2 * x * torch.tensor([[0.75], [1.0], [5.0]])
    assert torch.equal(combined, expected)


def test_low_latency_capacity_limit():
    """At its limit a dispatch fills one expert's slots; one token more is refused, naming both."""
    backend = _local_backend("deepep_low_latency", num_max_dispatch_tokens_per_rank=5)
    x, w = torch.randn(5, 3), torch.ones(5, 1)
    ids = torch.zeros(5, 1, dtype=torch.long)  # every token to expert 0
    result = backend.dispatch(x, ids, w).wait()
    assert result.expert_num_tokens.tolist() == [5, 0, 0, 0]
    assert torch.equal(result.hidden_states[0], x)
    with pytest.raises(
        ValueError,
        match=r"dispatch of 6 tokens per rank exceeds num_max_dispatch_tokens_per_rank=5",
    ):
        backend.dispatch(torch.randn(6, 3), torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1))
    with pytest.raises(ValueError, match=r"dispatch of 7 tokens per rank exceeds .*=5"):
        backend.dispatch_capacity(5, [5, 7])  # another rank's agreed count is checked too
    assert backend.dispatch_capacity(3, [3, 2]) == 3  # the call's slots: the agreed max
    assert backend.dispatch_capacity(0, [0, 0]) == 1 and backend.dispatch_capacity(2, None) == 5
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank must be >= 1, got 0"):
        _local_backend("deepep_low_latency", num_max_dispatch_tokens_per_rank=0)
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=9 must be in \[1, 5\]"):
        _local_buffer(5).low_latency_dispatch(x, ids, 9, 4, use_fp8=False)


def test_make_prepare_finalize_routes_options_by_the_class_attribute(monkeypatch):
    seen = {}

    class OptionBackend(
        AllToAllPrepareAndFinalize
    ):  # declares an option no registered backend takes
        name = "option_backend"
        extra_options = ("num_option_rows",)

        def __init__(self, *, num_option_rows, **kwargs):
            super().__init__(**kwargs)
            seen["num_option_rows"] = num_option_rows

    monkeypatch.setitem(BACKENDS, OptionBackend.name, OptionBackend)
    kw = {"ep_group": None, "ep_rank": 0, "ep_size": 1, "num_experts": 4}
    kw |= {"timeout": datetime.timedelta(seconds=5), "num_option_rows": 7, "hidden_size": 8}
    kw["num_max_dispatch_tokens_per_rank"] = 16
    assert isinstance(make_prepare_finalize("option_backend", **kw), OptionBackend)
    assert seen == {"num_option_rows": 7}
    low_latency = make_prepare_finalize("deepep_low_latency", **kw)  # DeepEP's options only
    assert low_latency.num_max_dispatch_tokens_per_rank == 16
    assert (
        type(make_prepare_finalize("all_to_all", **kw)) is AllToAllPrepareAndFinalize
    )  # none of them
    with pytest.raises(TypeError, match=r"num_undeclared_rows"):
        make_prepare_finalize("all_to_all", **kw, num_undeclared_rows=1)


def test_only_deepeps_own_low_latency_kernels_limit_the_ubatches_in_flight():
    from distributed import DeepEPLLPrepareAndFinalize
    from distributed.all2all.deepep_buffer import DEEPEP_KERNELS
    from distributed.all2all.ep_backend import check_num_ubatches

    class KernelBuffer:  # stands in for deep_ep.Buffer: only its name is read at construction
        implementation = DEEPEP_KERNELS

    kw = {"ep_group": None, "ep_rank": 0, "ep_size": 1, "num_experts": 4}
    kw["timeout"] = datetime.timedelta(seconds=5)
    for name in BACKENDS:  # our implementations allocate each call's buffers: any count
        backend = make_prepare_finalize(name, **kw)
        assert backend.max_num_ubatches is None
        check_num_ubatches(backend, 16)
    kernels = DeepEPLLPrepareAndFinalize(**kw, buffer=KernelBuffer())
    assert kernels.max_num_ubatches == 2  # DeepEP double-buffers its low-latency results
    check_num_ubatches(kernels, 2)
    with pytest.raises(
        ValueError, match=r"--ubatch-size 3: deepep_low_latency \(deep_ep kernels\)"
    ):
        check_num_ubatches(kernels, 3)
    check_num_ubatches(None, 4)  # no expert parallelism: nothing in flight
