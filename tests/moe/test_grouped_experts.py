"""The experts' device path (``TorchExperts.forward_cuda``, ``apply_batched`` on that path,
``moe.fused_moe.grouped_experts``) against ``forward_native``, on CPU tensors: the path is pure
torch, so CI runs it without a GPU; the ``gpu`` tests at the end run the same on CUDA.

Tolerances: float64 within 1e-12 of the output magnitude (summation order only); float32 and
bfloat16 are each compared with a float64 reference, the device path within 4x the reference
path's own error in that dtype plus one unit of its precision at the output magnitude (the two
round their GEMMs and sums differently, so a fixed bound between them would say nothing).
"""

from __future__ import annotations

import pytest
import torch

from distributed.all2all.base import DEBUG_CHECKS_ENV
from moe.fused_moe import cpu_experts, grouped_experts
from moe.fused_moe.experts import TorchExperts
from moe.fused_moe.grouped_experts import group_by_expert, grouped_mm_runs
from moe.platforms import CudaPlatform, set_current_platform


@pytest.fixture(autouse=True)
def _restore_platform():
    yield
    set_current_platform(None)


def _experts(dtype, *, num_experts=6, hidden=32, inter=24, seed=0, device="cpu"):
    """Experts with weights ~N(0, 0.3^2), drawn in float64 and rounded to ``dtype``, and their
    float64 twin (same rounded values) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    kw = {"num_local_experts": num_experts, "hidden_size": hidden, "intermediate_size": inter}
    experts = TorchExperts(**kw, dtype=dtype, device=device)
    exact = TorchExperts(**kw, dtype=torch.float64, device=device)
    with torch.no_grad():
        for p, q in zip(experts.parameters(), exact.parameters(), strict=True):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
            q.copy_(p.double())
    return experts, exact


def _routing(num_tokens, num_topk, low, high, *, hidden=32, dtype, seed=1, device="cpu"):
    """Rows ~N(0, 1) and ids uniform in [low, high) (-1: another rank's slot), weights in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, high, (num_tokens, num_topk), generator=gen).clamp(min=-1)
    weights = torch.rand(num_tokens, num_topk, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    return x.to(device), ids.to(device), weights.to(device)


def _assert_matches_reference(fast, native, exact, dtype):
    """``fast`` and ``native`` (both in ``dtype``) vs the float64 ``exact`` (module docstring)."""
    exact = exact.double()
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    if dtype == torch.float64:
        torch.testing.assert_close(fast, exact, rtol=0, atol=1e-12 * max(scale, 1.0))
        return
    fast_error = float((fast.double() - exact).abs().max()) if exact.numel() else 0.0
    native_error = float((native.double() - exact).abs().max()) if exact.numel() else 0.0
    bound = 4 * native_error + torch.finfo(dtype).eps * scale
    assert fast_error <= bound, (fast_error, native_error, scale)


def test_group_by_expert_hand_worked():
    """Pairs (row, slot) flattened as row * K + slot: [2, -1 | 0, 2 | 2, 0] with E = 3 sort to
    expert 0: pairs 2, 5; expert 1: none; expert 2: pairs 0, 3, 4; the -1 slot last."""
    groups = group_by_expert(torch.tensor([[2, -1], [0, 2], [2, 0]]), 3)
    assert groups.order.tolist() == [2, 5, 0, 3, 4, 1]
    assert groups.token_idx.tolist() == [1, 2, 0, 1, 2, 0]
    assert groups.offsets.tolist() == [2, 2, 5] and groups.offsets.dtype == torch.int32
    assert groups.is_local.tolist() == [True] * 5 + [False]
    # ids past the local range (here 3 with E = 3) are no local expert either
    assert group_by_expert(torch.tensor([[3], [1]]), 3).offsets.tolist() == [0, 1, 1]


# (num_tokens, num_topk, low id, high id): experts 4 and 5 get nothing; one token per expert;
# a row count that is no multiple of any block size, with duplicate ids in a row; every slot on
# another rank; no token at all
ROUTINGS = {
    "empty_experts": (40, 3, -1, 4),
    "one_token_groups": (6, 1, 0, 6),
    "odd_rows_duplicates": (37, 4, -3, 6),
    "all_remote": (5, 2, -1, 0),
    "no_tokens": (0, 2, -1, 6),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_forward_cuda_equals_native(dtype, routing):
    experts, exact = _experts(dtype)
    x, ids, weights = _routing(*ROUTINGS[routing], dtype=dtype)
    if routing == "one_token_groups":
        ids = torch.randperm(6, generator=torch.Generator().manual_seed(2))[:, None]
    # float32 / bfloat16 take the grouped GEMMs, float64 the dense formulation
    assert grouped_mm_runs(x, experts.expert_weights()) == (dtype != torch.float64)
    with torch.no_grad():
        fast = experts.forward_cuda(x, ids, weights)
        native = experts.forward_native(x, ids, weights)
        reference = exact.forward_native(x.double(), ids, weights.double())
    assert fast.shape == x.shape and fast.dtype == dtype
    _assert_matches_reference(fast, native, reference, dtype)
    assert fast[(ids < 0).all(dim=1)].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unaligned_row_strides_take_the_dense_formulation(dtype, monkeypatch):
    """torch._grouped_mm needs row strides of 16-byte multiples (H = 30, F = 20 in bfloat16 are
    60 and 40 bytes): the dense formulation runs, with the same result."""
    calls = []
    dense = grouped_experts.dense_experts
    monkeypatch.setattr(
        "moe.fused_moe.experts.dense_experts", lambda *a: calls.append(1) or dense(*a)
    )
    experts, exact = _experts(dtype, hidden=30, inter=20 if dtype == torch.bfloat16 else 21)
    x, ids, weights = _routing(23, 2, -1, 6, hidden=30, dtype=dtype)
    assert not grouped_mm_runs(x, experts.expert_weights())
    with torch.no_grad():
        fast, native = (
            experts.forward_cuda(x, ids, weights),
            experts.forward_native(x, ids, weights),
        )
        reference = exact.forward_native(x.double(), ids, weights.double())
    assert calls == [1]
    _assert_matches_reference(fast, native, reference, dtype)
    # the CPU path's grouped GEMM takes the reference there (torch raised before)
    with torch.no_grad():
        assert torch.equal(cpu_experts.forward_grouped(experts, x, ids, weights), native)


def test_dense_formulation_where_grouped_mm_cannot_run_and_the_reference_above_its_cap(
    monkeypatch,
):
    experts, exact = _experts(torch.float32)
    x, ids, weights = _routing(40, 3, -1, 6, dtype=torch.float32)
    monkeypatch.setattr(grouped_experts, "grouped_mm_unavailable", lambda *_: "probe said no")
    assert not grouped_mm_runs(x, experts.expert_weights())
    with torch.no_grad():
        reference = exact.forward_native(x.double(), ids, weights.double())
        native = experts.forward_native(x, ids, weights)
        _assert_matches_reference(experts.forward_cuda(x, ids, weights), native, reference, x.dtype)
        monkeypatch.setattr(grouped_experts, "DENSE_MAX_ELEMENTS", 6 * 40 * 48 - 1)
        calls = []
        monkeypatch.setattr(experts, "forward_native", lambda *a: calls.append(1) or native)
        assert experts.forward_cuda(x, ids, weights) is native and calls == [1]


def test_gate_and_up_are_one_tensor_and_are_joined_again_after_a_move():
    """w1 and w3 are halves of one allocation ([w1; w3] is a view: one GEMM); ``.double()``
    splits them (two GEMMs, same result) and ``process_weights_after_loading`` joins them."""
    experts, _ = _experts(torch.float32)
    gate_up = experts.expert_weights().gate_up
    assert gate_up is not None and gate_up.data_ptr() == experts.w1.data_ptr()
    assert torch.equal(gate_up, torch.cat([experts.w1, experts.w3], dim=1))
    moved = experts.double()
    assert moved.expert_weights().gate_up is None
    x, ids, weights = _routing(17, 2, -1, 6, dtype=torch.float64)
    with torch.no_grad():
        split = moved.forward_cuda(x, ids, weights)
        moved.process_weights_after_loading()
        assert moved.expert_weights().gate_up is not None
        torch.testing.assert_close(moved.forward_cuda(x, ids, weights), split, rtol=0, atol=1e-12)
        torch.testing.assert_close(split, moved.forward_native(x, ids, weights), rtol=0, atol=1e-12)


def _batched_rows(experts, counts, max_tokens, dtype, seed=3):
    """``[E, M, H]`` rows: the first counts[e] of expert e random, the rest NaN (DeepEP leaves them
    unspecified)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((len(counts), max_tokens, experts.hidden_size), float("nan"), dtype=dtype)
    for e, n in enumerate(counts):
        rows[e, :n] = torch.randn(n, experts.hidden_size, generator=gen).to(dtype)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batched_format_on_the_cuda_path_equals_the_per_expert_reference(dtype):
    """Counts 0, 1, M and in between; rows past the counts are NaN and come back zero."""
    set_current_platform(CudaPlatform())
    experts, exact = _experts(dtype)
    assert experts.forward_path == "forward_cuda" and exact.forward_path == "forward_cuda"
    counts, max_tokens = [0, 1, 7, 3, 7, 5], 7
    rows = _batched_rows(experts, counts, max_tokens, dtype)
    with torch.no_grad():
        fast = experts.apply_batched(rows, torch.tensor(counts))
        native = experts.apply_batched_native(rows, torch.tensor(counts))
        reference = exact.apply_batched_native(rows.double(), torch.tensor(counts))
    assert fast.shape == rows.shape and fast.dtype == dtype and not fast.isnan().any()
    for e, n in enumerate(counts):
        assert not fast[e, n:].any()
    _assert_matches_reference(fast, native, reference, dtype)


def test_cuda_platform_binds_forward_cuda_and_checks_shapes_without_reading_values(monkeypatch):
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")  # the shape checks run under the debug flag
    set_current_platform(CudaPlatform())
    experts, _ = _experts(torch.float32)
    assert experts.forward_path == "forward_cuda"
    x, ids, weights = _routing(4, 2, 0, 6, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"topk_ids \(4, 1\) / topk_weights \(4, 2\)"):
        experts.apply_standard(x, ids[:, :1], weights)
    with pytest.raises(ValueError, match=r"expert_num_tokens must be \[6\]"):
        experts.apply_batched(torch.zeros(6, 2, 32), torch.zeros(5, dtype=torch.int64))
    # an id past the local range adds nothing here (the reference refuses it: reading ids)
    out = experts(x, torch.full_like(ids, 6), weights)
    assert out.eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_forward_cuda_on_a_gpu_equals_native(dtype, routing):
    experts, exact = _experts(dtype, device="cuda")
    x, ids, weights = _routing(*ROUTINGS[routing], dtype=dtype, device="cuda")
    with torch.no_grad():
        fast = experts.forward_cuda(x, ids, weights)
        native = experts.forward_native(x, ids, weights)
        reference = exact.forward_native(x.double(), ids, weights.double())
    _assert_matches_reference(fast, native, reference, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_cuda_runs_without_a_sync_and_replays_in_a_cuda_graph(dtype):
    """Under ``set_sync_debug_mode("error")`` any host synchronisation raises; a CUDA graph
    captured on one routing and replayed on another gives that routing's result."""
    set_current_platform(CudaPlatform())
    experts, _ = _experts(dtype, device="cuda")
    x, ids, weights = _routing(40, 3, -1, 6, dtype=dtype, device="cuda")
    x2, ids2, weights2 = _routing(40, 3, -1, 6, dtype=dtype, device="cuda", seed=5)
    counts = torch.tensor([0, 5, 2, 1, 5, 3], device="cuda")
    rows = _batched_rows(experts, counts.tolist(), 5, dtype).cuda()
    with torch.no_grad():
        expected = experts.forward_cuda(x2, ids2, weights2)  # probes grouped_mm, eagerly
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            experts.forward_cuda(x, ids, weights)
            experts.apply_batched(rows, counts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts.forward_cuda(x, ids, weights)
        for static, new in ((x, x2), (ids, ids2), (weights, weights2)):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
