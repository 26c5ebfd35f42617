"""Our Triton fused-MoE kernels (``moe.fused_moe.triton_experts``, ``forward_cuda`` with
``MOE_DBO_CUDA_EXPERTS=triton``) against ``forward_native``: on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``; where there is no GPU,
``test_interpreted_kernels_in_a_fresh_process`` runs this module's interpreted tests in a process
of their own), on CUDA in the ``gpu`` tests. Skipped with the reason where triton is not
installed; the package itself
imports and runs without it (``test_the_package_imports_and_runs_the_cuda_paths_without_triton``).

Bounds as tests/moe/test_grouped_experts.py: each dtype against the float64 reference, within 4x
the reference path's own error in that dtype plus one unit of its precision at the output
magnitude. Small shapes (a few hundred programs), so the interpreter takes seconds.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe.fused_moe import triton_experts
from moe.fused_moe.experts import CUDA_EXPERTS_ENV, CudaExpertsBackend, TorchExperts
from moe.fused_moe.triton_experts import align_pairs
from moe.platforms import CudaPlatform, set_current_platform
from tests.moe.test_grouped_experts import _assert_matches_reference, _experts, _routing


@pytest.fixture(autouse=True)
def _restore_platform():
    yield
    set_current_platform(None)


def _kernels_module(*, interpreted: bool):
    """``moe.fused_moe.triton_kernels``, skipping the test unless triton is installed and runs
    as wanted: in its interpreter (CPU tensors) or compiled (CUDA). Triton reads
    ``TRITON_INTERPRET`` when its kernels are defined, and setting it for the whole test process
    would make the CUDA platform's default attention the interpreted Triton one in every other
    test: the interpreted tests run in a fresh process of their own."""
    pytest.importorskip("triton", reason="triton is not installed")
    module = importlib.import_module("moe.fused_moe.triton_kernels")
    if module.is_interpreted() != interpreted:
        if interpreted and not torch.cuda.is_available():
            pytest.skip("interpreted in a process of its own (fresh_process test)")
        pytest.skip(f"triton {'compiles' if interpreted else 'interprets'} its kernels here")
    return module


@pytest.fixture
def interpreted():
    return _kernels_module(interpreted=True)


@pytest.fixture
def launches(monkeypatch):
    """The Triton launches of ``fused_experts`` (kernel names), which still run."""
    names = []
    launch = triton_experts.launch

    def counting(kernel, grid, *args, **meta):
        names.append(kernel.__name__)
        launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(triton_experts, "launch", counting)
    return names


def test_align_pairs_hand_worked():
    """Pairs [2, -1 | 0, 2 | 2, 0] with E = 3, blocks of 2: expert 0 holds pairs 2, 5; expert 1
    none; expert 2 pairs 0, 3, 4 and one padding (P = 6); the -1 slot (pair 1) is group 3, last.
    Worst case 6 + 4 * 1 = 10 positions, 5 blocks."""
    aligned = align_pairs(torch.tensor([[2, -1], [0, 2], [2, 0]]), 3, 2)
    assert aligned.sorted_pair_ids.tolist() == [2, 5, 0, 3, 4, 6, 1, 6, 6, 6]
    assert aligned.num_padded.tolist() == [8]
    assert aligned.block_expert_ids[:4].tolist() == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="block_m must be a power of two, got 3"):
        align_pairs(torch.tensor([[0]]), 3, 3)


# (num_tokens, num_topk, low id, high id): experts 4 and 5 get nothing (top-3), top-1 with one
# token per expert, top-4 on 37 rows (no multiple of any block) with duplicate ids and other
# ranks' slots, top-6 with no local slot in some rows, every slot on another rank
ROUTINGS = {
    "empty_experts": (40, 3, -1, 4),
    "top1": (6, 1, 0, 6),
    "top4_odd_rows": (37, 4, -3, 6),
    "top6": (11, 6, -2, 6),
    "all_remote": (5, 2, -1, 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_triton_experts_equal_native(interpreted, launches, monkeypatch, dtype, routing):
    monkeypatch.setenv(CUDA_EXPERTS_ENV, "triton")
    experts, exact = _experts(dtype)
    assert experts.cuda_backend is CudaExpertsBackend.TRITON
    x, ids, weights = _routing(*ROUTINGS[routing], dtype=dtype)
    with torch.no_grad():
        fast = experts.forward_cuda(x, ids, weights)
        native = experts.forward_native(x, ids, weights)
        reference = exact.forward_native(x.double(), ids, weights.double())
    assert launches == ["gate_up_silu_kernel", "down_weighted_kernel"]
    assert fast.shape == x.shape and fast.dtype == dtype
    _assert_matches_reference(fast, native, reference, dtype)
    assert fast[(ids < 0).all(dim=1)].eq(0).all()


def test_triton_experts_with_split_gate_up_and_large_blocks(interpreted, launches):
    """w1 and w3 as two tensors (after ``.to``) and more rows than experts (64-row blocks, two
    column blocks of down): the same sums."""
    experts, exact = _experts(torch.float32, hidden=80, inter=40)
    experts.w1.data = experts.w1.data.clone()  # now apart from w3, with other strides
    x, ids, weights = _routing(70, 2, -1, 6, hidden=80, dtype=torch.float32)
    assert not triton_experts.runs(x, experts.expert_weights())  # one stride set for both
    experts.w3.data = experts.w3.data.clone()
    assert experts.expert_weights().gate_up is None
    assert triton_experts.runs(x, experts.expert_weights())
    with torch.no_grad():
        fast = triton_experts.fused_experts(x, ids, weights, experts.expert_weights())
        native = experts.forward_native(x, ids, weights)
        reference = exact.forward_native(x.double(), ids, weights.double())
    assert len(launches) == 2
    _assert_matches_reference(fast, native, reference, torch.float32)


def test_float64_and_no_tokens_take_the_torch_paths(interpreted, launches, monkeypatch):
    monkeypatch.setenv(CUDA_EXPERTS_ENV, "triton")
    experts, _ = _experts(torch.float64)
    x, ids, weights = _routing(9, 2, -1, 6, dtype=torch.float64)
    assert not triton_experts.runs(x, experts.expert_weights())
    with torch.no_grad():
        torch.testing.assert_close(
            experts.forward_cuda(x, ids, weights), experts.forward_native(x, ids, weights)
        )
        assert experts.forward_cuda(x[:0], ids[:0], weights[:0]).shape == (0, 32)
    assert launches == []


def test_backend_setting_is_checked_when_the_experts_are_built(monkeypatch):
    monkeypatch.setenv(CUDA_EXPERTS_ENV, "cutlass")
    with pytest.raises(ValueError, match=r"MOE_DBO_CUDA_EXPERTS='cutlass' is not one of"):
        TorchExperts(num_local_experts=2, hidden_size=16, intermediate_size=16)
    monkeypatch.setenv(CUDA_EXPERTS_ENV, "")
    experts = TorchExperts(num_local_experts=2, hidden_size=16, intermediate_size=16)
    assert experts.cuda_backend is CudaExpertsBackend.GROUPED_MM  # the default
    monkeypatch.setenv(CUDA_EXPERTS_ENV, "triton")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="triton needs the triton package"):
        TorchExperts(num_local_experts=2, hidden_size=16, intermediate_size=16)


def test_the_package_imports_and_runs_the_cuda_paths_without_triton():
    """With triton unimportable, the package imports, the default CUDA experts run, and
    ``MOE_DBO_CUDA_EXPERTS=triton`` is refused with the reason."""
    script = textwrap.dedent(
        """
        import os, sys
        sys.modules["triton"] = None  # import triton raises ImportError
        import torch
        from moe.fused_moe.experts import TorchExperts
        from moe.platforms import CudaPlatform, set_current_platform
        set_current_platform(CudaPlatform())
        experts = TorchExperts(num_local_experts=2, hidden_size=16, intermediate_size=16)
        for p in experts.parameters():
            torch.nn.init.normal_(p)
        out = experts(torch.randn(3, 16), torch.tensor([[0], [1], [-1]]), torch.ones(3, 1))
        assert out.shape == (3, 16) and out.isfinite().all() and sys.modules["triton"] is None
        os.environ["MOE_DBO_CUDA_EXPERTS"] = "triton"
        try:
            TorchExperts(num_local_experts=2, hidden_size=16, intermediate_size=16)
        except ValueError as e:
            print("refused:", e)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "refused: MOE_DBO_CUDA_EXPERTS=triton needs the triton package" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_triton_experts_on_a_gpu_equal_native_without_a_sync(monkeypatch, dtype, routing):
    _kernels_module(interpreted=False)
    monkeypatch.setenv(CUDA_EXPERTS_ENV, "triton")
    set_current_platform(CudaPlatform())
    experts, exact = _experts(dtype, device="cuda")
    x, ids, weights = _routing(*ROUTINGS[routing], dtype=dtype, device="cuda")
    with torch.no_grad():
        experts.forward_cuda(x, ids, weights)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fast = experts.forward_cuda(x, ids, weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        native = experts.forward_native(x, ids, weights)
        reference = exact.forward_native(x.double(), ids, weights.double())
    _assert_matches_reference(fast, native, reference, dtype)


def test_interpreted_kernels_in_a_fresh_process():
    """This module's interpreted tests, in a process started under ``TRITON_INTERPRET=1`` (where
    this one compiles, or has no triton, they skip)."""
    pytest.importorskip("triton", reason="triton is not installed")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels run in this process (compiled on the GPU, or interpreted here)")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not fresh_process",
        ],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    # 10 equal-native cases, split gate/up, float64 and empty batches, and the host-side tests
    assert passed and int(passed.group(1)) >= 12, output[-3000:]
