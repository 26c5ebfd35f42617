"""``distributed``'s all-to-all backends: dispatch → reference experts → combine, checked against
a single-process reference.

Every rank regenerates ALL ranks' inputs from seeds, so each rank can compute the exact rows it
must receive and the combined output each of its tokens must get.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from distributed import (
    BACKENDS,
    BatchedDispatchResult,
    init_distributed,
    make_prepare_finalize,
)
from distributed.all2all.base import DEBUG_CHECKS_ENV
from distributed.all2all.token_packing import (
    localize_topk,
)
from tests.helpers.all2all import (
    HIDDEN_SIZE,
    apply_experts,
    assert_close,
    expert_scales,
    make_inputs,
    run_experts,
    valid_batched_rows,
)
from tests.helpers.distributed import run_distributed

TOLERANCES = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (3e-2, 3e-2)}


# ---------------------------------------------------------------- inputs and reference experts


# ---------------------------------------------------------------- per-rank checks


def _case_inputs(case, rank, seed=None):
    return make_inputs(
        case["seed"] if seed is None else seed,
        rank,
        case["counts"][rank],
        case["num_topk"],
        case["num_experts"],
        case["dtype"],
        skew=case.get("skew", False),
    )


def _expected_rows(case, ep_rank, num_local_experts):
    """Rows ep_rank must receive, in (source rank, token) order, with local ids and weights."""
    rows = ([], [], [])
    for src in range(len(case["counts"])):
        x, ids, w = _case_inputs(case, src)
        local_ids, local_w = localize_topk(ids, w, ep_rank, num_local_experts=num_local_experts)
        keep = (local_ids >= 0).any(dim=1)
        for store, value in zip(rows, (x[keep], local_ids[keep], local_w[keep]), strict=True):
            store.append(value)
    return tuple(torch.cat(parts) for parts in rows)


def _expected_batched_rows(case, ep_rank, num_local_experts) -> list[torch.Tensor]:
    """Per local expert, the rows it must receive (DeepEP low latency: once per (token, expert)),
    in (source rank, token) order."""
    first = ep_rank * num_local_experts
    rows: list[list[torch.Tensor]] = [[] for _ in range(num_local_experts)]
    for src in range(len(case["counts"])):
        x, ids, _ = _case_inputs(case, src)
        for local in range(num_local_experts):
            rows[local].append(x[(ids == first + local).any(dim=1)])
    return [torch.cat(parts) for parts in rows]


def _assert_same_result(a, b) -> None:
    if isinstance(a, BatchedDispatchResult):
        assert torch.equal(a.expert_num_tokens, b.expert_num_tokens)
        for rows_a, rows_b in zip(valid_batched_rows(a), valid_batched_rows(b), strict=True):
            assert torch.equal(rows_a, rows_b)
        return
    for name in ("hidden_states", "topk_ids", "topk_weights"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _check_received(result, case, ep_rank, backend) -> int:
    """Assert ``result`` holds exactly the rows ``ep_rank`` must receive; return their count."""
    dtype = case["dtype"]
    if isinstance(result, BatchedDispatchResult):
        assert result.hidden_states.dtype == dtype
        assert result.expert_num_tokens.dtype == torch.int32
        capacity = result.metadata.num_max_dispatch_tokens_per_rank
        assert result.hidden_states.shape == (
            backend.num_local_experts,
            backend.ep_size * capacity,
            HIDDEN_SIZE,
        )
        expected = _expected_batched_rows(case, ep_rank, backend.num_local_experts)
        for rows, exp in zip(valid_batched_rows(result), expected, strict=True):
            assert torch.equal(rows, exp)
        return int(result.expert_num_tokens.sum())
    exp_x, exp_ids, exp_w = _expected_rows(case, ep_rank, backend.num_local_experts)
    hidden, ids, weights = result.hidden_states, result.topk_ids, result.topk_weights
    assert hidden.dtype == dtype and ids.dtype == torch.int64 and weights.dtype == torch.float32
    if backend.name == "allgather_reducescatter":
        # every gathered row comes back (no value-dependent shape): max(counts) per rank, the
        # rows without a local expert (padding included) with ids -1 and weights 0
        assert hidden.shape[0] == len(case["counts"]) * max(case["counts"])
        has_local = (ids >= 0).any(dim=1)
        assert not weights[~has_local].any()
        hidden, ids, weights = hidden[has_local], ids[has_local], weights[has_local]
    assert torch.equal(hidden, exp_x)
    assert torch.equal(ids, exp_ids)
    assert torch.equal(weights, exp_w)
    return hidden.shape[0]


def _run_case(backend, case, ep_rank) -> dict:
    dtype, seed = case["dtype"], case["seed"]
    num_experts = case["num_experts"]
    x, ids, w = _case_inputs(case, ep_rank)
    scales = expert_scales(seed, num_experts)
    first_expert = ep_rank * backend.num_local_experts

    # sync dispatch: already complete; the received rows are exactly the expected ones
    handle = backend.dispatch(x, ids, w)
    assert handle.is_completed()
    result = handle.wait()
    assert handle.wait() is result
    timing = handle.timing
    assert timing.completed_at_ns is not None and timing.completed_at_ns >= timing.issued_at_ns
    num_recv_tokens = _check_received(result, case, ep_rank, backend)

    # experts → sync combine equals the single-process reference
    def experts(res):
        return run_experts(res, scales, first_expert)

    combine = backend.combine(experts(result), result.metadata)
    out = combine.wait()
    assert combine.wait() is out
    reference = apply_experts(x, ids, w, scales, 0).to(dtype)
    atol, rtol = TOLERANCES[dtype]
    assert out.shape == (x.shape[0], HIDDEN_SIZE) and out.dtype == dtype
    assert_close(out, reference, atol=atol, rtol=rtol)

    # async, two "ubatches" in flight and waited in reverse order: same as sync
    x2, ids2, w2 = _case_inputs(case, ep_rank, seed=seed + 1)
    h_a = backend.dispatch(x, ids, w, async_op=True)
    h_b = backend.dispatch(x2, ids2, w2, async_op=True)
    res_b, res_a = h_b.wait(), h_a.wait()
    assert h_a.wait() is res_a and h_a.is_completed()
    _assert_same_result(res_a, result)
    c_a = backend.combine(experts(res_a), res_a.metadata, async_op=True)
    c_b = backend.combine(experts(res_b), res_b.metadata, async_op=True)
    out_b, out_a = c_b.wait(), c_a.wait()
    assert c_a.wait() is out_a
    assert torch.equal(out_a, out)
    reference_b = apply_experts(x2, ids2, w2, scales, 0).to(dtype)
    assert_close(out_b, reference_b, atol=atol, rtol=rtol)
    for h in (h_a, h_b, c_a, c_b):
        timing = h.timing
        assert timing.completed_at_ns is not None and timing.completed_at_ns >= timing.issued_at_ns
        assert timing.num_bytes >= 0 and timing.finish_ns is not None

    # token counts known to the caller (as under DBO): same rows; only the backends whose count
    # exchange depends on the routing (all_to_all, DeepEP HT's notify) still block on one
    h_known = backend.dispatch(x, ids, w, async_op=True, num_tokens_across_ep=case["counts"])
    _assert_same_result(h_known.wait(), result)
    # all_to_all pads small dispatches instead (these cases are all below its limit)
    padded = backend.name == "all_to_all"
    assert (h_known.timing.notify_ns is None) == (padded or not backend.blocks_under_dbo)
    if padded:  # and its combine of a padded dispatch returns the same result
        known_out = backend.combine(experts(h_known.wait()), h_known.wait().metadata).wait()
        assert torch.equal(known_out, out)
    wrong = list(case["counts"])
    wrong[ep_rank] += 1
    with pytest.raises(ValueError, match=r"num_tokens_across_ep=.* entry \d+ equal to this rank"):
        backend.dispatch(x, ids, w, num_tokens_across_ep=wrong)
    return {"num_recv_tokens": num_recv_tokens, "skew": case.get("skew", False)}


def _all2all_rank(rank: int, world_size: int, cases: list[dict]) -> list:
    groups = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=True, timeout_s=30.0
    )
    summaries = []
    for case in cases:
        backend = make_prepare_finalize(
            case["backend"],
            ep_group=groups.ep_group,
            ep_rank=groups.ep_rank,
            ep_size=groups.ep_size,
            num_experts=case["num_experts"],
            timeout=groups.timeout,
            # DeepEP LL: sized for the largest rank, which dispatches at the capacity limit
            num_max_dispatch_tokens_per_rank=max(1, *case["counts"]),
        )
        summaries.append(_run_case(backend, case, groups.ep_rank))
    if world_size == 2:
        summaries.append(_cross_thread_waits(groups))
        summaries.append(_with_fallback_collectives(groups, cases[-1]))
        summaries.append(_mismatch_and_timeout(groups))  # last: it leaves the group timed out
    return summaries


def _with_fallback_collectives(groups, case) -> dict:
    """Older torch / other backends: all_gather list form and all_reduce + slice must agree."""
    import torch.distributed as dist

    def unsupported(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support this op (simulated)")

    saved = {
        name: getattr(dist, name, None) for name in ("all_gather_single", "reduce_scatter_single")
    }
    try:
        for name in saved:
            setattr(dist, name, unsupported)
        backend = make_prepare_finalize(
            "allgather_reducescatter",
            ep_group=groups.ep_group,
            ep_rank=groups.ep_rank,
            ep_size=groups.ep_size,
            num_experts=case["num_experts"],
            timeout=groups.timeout,
        )
        return _run_case(
            backend, {**case, "counts": [3, 5], "num_topk": 2, "skew": False}, groups.ep_rank
        )
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(dist, name)
            else:
                setattr(dist, name, fn)


def _cross_thread_waits(groups) -> dict:
    """DBO's recv hook: a handle issued by one thread is waited by others, concurrently."""
    checked = {}
    for name in BACKENDS:
        backend = make_prepare_finalize(
            name,
            ep_group=groups.ep_group,
            ep_rank=groups.ep_rank,
            ep_size=2,
            num_experts=4,
            timeout=groups.timeout,
        )
        inputs = make_inputs(50, groups.ep_rank, 4 + groups.ep_rank, 2, 4, torch.float32)
        sync = backend.dispatch(*inputs).wait()
        handle = backend.dispatch(*inputs, async_op=True)
        results = []

        def wait_into(handle=handle, results=results):
            results.append(handle.wait())

        threads = [threading.Thread(target=wait_into) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)  # blocking wait (timeout 20 s)
        assert len(results) == 3 and all(r is results[0] for r in results)
        _assert_same_result(results[0], sync)
        checked[name] = True
    return checked


# Backends that exchange a header before the payload, which checks the row format: DeepEP's low
# latency protocol has none (like DeepEP, it requires every rank to pass the same shapes).
CHECKS_ROW_FORMAT = [name for name in BACKENDS if name != "deepep_low_latency"]


def _mismatch_and_timeout(groups) -> dict:
    """Row-format mismatch → ValueError on every rank; a peer that never joins → TimeoutError."""
    errors = {}
    for name in CHECKS_ROW_FORMAT:
        backend = make_prepare_finalize(
            name,
            ep_group=groups.ep_group,
            ep_rank=groups.ep_rank,
            ep_size=2,
            num_experts=4,
            timeout=groups.timeout,
        )
        hidden = 8 if groups.ep_rank == 0 else 9
        try:
            backend.dispatch(
                torch.zeros(2, hidden), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
            )
        except ValueError as exc:
            errors[name] = str(exc)
    short = make_prepare_finalize(
        "all_to_all",
        ep_group=groups.ep_group,
        ep_rank=groups.ep_rank,
        ep_size=2,
        num_experts=4,
        timeout=datetime.timedelta(seconds=0.2),
    )
    if groups.ep_rank == 0:
        try:
            short.dispatch(torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
        except TimeoutError as exc:
            errors["timeout"] = str(exc)
    else:
        time.sleep(0.8)  # stay alive (not joining) so rank 0 times out rather than seeing a close
    return errors


def _cases(world_size: int) -> list[dict]:
    # per world size: (counts, num_topk, skew); the skewed case sends every token to experts
    # 0..num_topk-1, so the last ranks receive nothing and one expert's slots fill to capacity
    specs = {
        2: [([5, 0], 3, False), ([0, 0], 1, False), ([4, 6], 1, True)],
        4: [([7, 0, 3, 12], 3, False), ([1, 2, 0, 0], 1, False), ([3, 5, 0, 2], 2, True)],
    }[world_size]
    cases = []
    for backend in BACKENDS:
        for dtype in (torch.float32, torch.bfloat16):
            for i, (case_counts, num_topk, skew) in enumerate(specs):
                cases.append(
                    {
                        "backend": backend,
                        "dtype": dtype,
                        "counts": case_counts,
                        "num_topk": num_topk,
                        "num_experts": 8,
                        "skew": skew,
                        "seed": 10 * i + (dtype == torch.bfloat16),
                    }
                )
    return cases


@pytest.mark.parametrize(
    ("world_size", "cpu_kernels"),
    # kernels off: the rows packed and unpacked by the torch ops, the path on other devices
    [(2, "1"), (4, "1"), (2, "0")],
)
def test_dispatch_experts_combine_matches_reference(world_size, cpu_kernels):
    cases = _cases(world_size)
    # the debug checks on: every dispatch's result is checked on arrival, a wrong count refused
    env = {DEBUG_CHECKS_ENV: "1", "MOE_DBO_CPU_KERNELS": cpu_kernels}
    results = run_distributed(_all2all_rank, world_size, cases, timeout_s=240, env=env)
    for rank, summaries in enumerate(results):
        assert len(summaries) == len(cases) + 3 * (world_size == 2)
        if world_size == 2:
            assert summaries[-3] == dict.fromkeys(BACKENDS, True)  # cross-thread waits
            assert summaries[-2]["num_recv_tokens"] > 0  # fallback collectives
            errors = summaries[-1]
            for name in CHECKS_ROW_FORMAT:
                assert "differ across EP ranks" in errors[name], (rank, errors)
            if rank == 0:
                assert "all_to_all dispatch count exchange on rank 0" in errors["timeout"]
                assert "did not complete within 0.2 s" in errors["timeout"]
    # rank 1 of the first 2-rank case has 0 tokens of its own but receives some
    if world_size == 2:
        assert results[1][0]["num_recv_tokens"] > 0
    # skewed routing: the last rank receives nothing, the first receives every token
    for i, case in enumerate(cases):
        if case["skew"]:
            assert results[-1][i]["num_recv_tokens"] == 0, (case, results[-1][i])
            assert results[0][i]["num_recv_tokens"] > 0, (case, results[0][i])


# ---------------------------------------------------------------- single-process unit tests
