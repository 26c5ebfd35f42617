"""Our compiled experts kernel (``moe/kernels/csrc/fused_moe_cpu.cpp``, reached through
``TorchExperts.forward_cpu`` and ``apply_batched``) against the exact result: the reference
(``forward_native``) in float64 on the same rounded weights and rows, for every ISA build this CPU
runs (``tests/helpers/cpu_kernels.py``).

Bounds: float32 within 4x the float32 reference's own error; bfloat16 within one rounding of the
exact value (the kernel computes in float32 and rounds once: |error| <= 2^-8 |exact|, plus
float32's summation error), plus, on the avx512_bf16 build (which multiplies bfloat16 pairs, so
rounds the SwiGLU output h to bfloat16 before down, as the reference does), one rounding of each
term of down: 2^-8 sum_k |w_k| sum_f |h_f| |W2[:, f]|. Shapes cover row tiles cut short (8 rows
with AVX-512, 6 with AVX2), an intermediate size that is not a multiple of the vector width,
weights split into column chunks, experts with no rows and slots routed to other ranks. The
kernel's measured cut is pinned here (kernel everywhere unless a test says otherwise); the
measurement has tests of its own.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe import TorchExperts
from moe.fused_moe import cpu_experts
from moe.kernels import host as kernels_host
from moe.kernels import tuning
from moe.layers.linear import process_weights_after_loading
from tests.helpers.cpu_kernels import ISAS, kernel_module_for

BF16_ROUNDING = 2**-8  # one round-to-nearest to bfloat16 (8 significant bits), relative


@pytest.fixture(params=ISAS)
def kernel_calls(request, monkeypatch):
    """Names of the compiled kernel's calls (built for each ISA this CPU runs, the others skip),
    which the experts then use."""
    module = kernel_module_for(request.param)
    calls = KernelCalls(k_group=cpu_experts.k_group(module, torch.bfloat16))

    class Counting:
        def __getattr__(self, name):
            return getattr(module, name)

        def fused_moe(self, *args):
            calls.append("fused_moe")
            return module.fused_moe(*args)

        def fused_moe_batched(self, *args):
            calls.append("fused_moe_batched")
            return module.fused_moe_batched(*args)

    monkeypatch.setattr(kernels_host, "cpu_kernels", lambda _isa: Counting())
    monkeypatch.setattr(cpu_experts, "tuned_max_rows", lambda *_: math.inf)
    return calls


class KernelCalls(list):
    """The names of the kernel's calls, and its build's ``k_group`` for bfloat16 weights."""

    def __init__(self, *, k_group: int):
        super().__init__()
        self.k_group = k_group

    def down_rounding(self, exact, x, ids, weights, dtype):
        """Where the build rounds h to bfloat16 before down: sum_k |w_k| sum_f |h_f| |W2[:, f]|
        per output element (float64, ``exact``'s weights), else None."""
        if dtype != torch.bfloat16 or self.k_group == 1:
            return None
        scale = torch.zeros(x.shape[0], exact.hidden_size, dtype=torch.float64)
        x = x.double()
        for token, slot in (ids >= 0).nonzero().tolist():
            expert = int(ids[token, slot])
            gate, up = exact.w1[expert] @ x[token], exact.w3[expert] @ x[token]
            hidden = torch.nn.functional.silu(gate) * up
            scale[token] += abs(float(weights[token, slot])) * (
                exact.w2[expert].abs() @ hidden.abs()
            )
        return scale


def make_experts(dtype, *, num_experts=6, hidden=32, inter=24, seed=0):
    """Experts of ``dtype`` and their float64 twin with the same (rounded) weights."""
    gen = torch.Generator().manual_seed(seed)
    kw = {"num_local_experts": num_experts, "hidden_size": hidden, "intermediate_size": inter}
    experts = TorchExperts(**kw, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    process_weights_after_loading(experts)
    exact = TorchExperts(**kw, dtype=torch.float64)
    exact.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    return experts, exact


def check(out, ref, exact, dtype, down_rounding=None):
    """``out`` (kernel) against ``exact`` (float64): bfloat16 within one rounding (plus one of each
    term of down where ``down_rounding``, ``KernelCalls.down_rounding``, is given), float32 within
    4x the error of ``ref`` (the reference run in float32) against ``exact``."""
    err = (out.double() - exact).abs()
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    if dtype == torch.bfloat16:
        bound = BF16_ROUNDING * exact.abs() + 1e-5 * scale
        if down_rounding is not None:
            bound = bound + BF16_ROUNDING * down_rounding
    else:
        ref_err = float((ref.double() - exact).abs().max()) if exact.numel() else 0.0
        bound = 4 * ref_err + 2**-20 * scale
    assert bool((err <= bound).all()), f"max error {float(err.max())} over the bound"


def routed(num_tokens, topk, num_experts, seed=1):
    """Ids with -1 slots (other ranks) and the last two experts never chosen; float32 weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_experts - 2, (num_tokens, topk), generator=gen)
    return ids, torch.rand(num_tokens, topk, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 9, 40])
@pytest.mark.parametrize(("hidden", "inter"), [(32, 24), (64, 8)])
def test_kernel_equals_the_exact_result(kernel_calls, dtype, num_tokens, hidden, inter):
    experts, exact = make_experts(dtype, hidden=hidden, inter=inter)
    ids, weights = routed(num_tokens, 3, 6)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        out = experts(x, ids, weights)
        ref = experts.forward_native(x, ids, weights)
        want = exact.forward_native(x.double(), ids, weights.double())
    assert kernel_calls == ["fused_moe"] and out.dtype == dtype and out.shape == x.shape
    check(out, ref, want, dtype, kernel_calls.down_rounding(exact, x, ids, weights, dtype))
    assert out[(ids == -1).all(dim=1)].eq(0).all()  # no local slot: zero rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_large_hidden_runs_in_column_chunks(kernel_calls, dtype):
    """H = 2048: gate_up's weights are read in several L2-sized column chunks, and so are
    down's output columns; 20 rows per expert span row tiles cut short."""
    experts, exact = make_experts(dtype, num_experts=3, hidden=2048, inter=48)
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(30)])
    weights, x = torch.rand(30, 2, generator=gen), torch.randn(30, 2048, generator=gen).to(dtype)
    with torch.no_grad():
        out, ref = experts(x, ids, weights), experts.forward_native(x, ids, weights)
        exact_out = exact.forward_native(x.double(), ids, weights.double())
        check(out, ref, exact_out, dtype, kernel_calls.down_rounding(exact, x, ids, weights, dtype))
    assert kernel_calls == ["fused_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_batched_layout_equals_the_exact_result(kernel_calls, dtype):
    """``apply_batched`` (DeepEP low-latency's ``[E, M, H]`` + counts, unweighted): each expert's
    first rows, the rows past its count zero whatever they held (NaN here)."""
    experts, exact = make_experts(dtype)
    counts = torch.tensor([3, 0, 9, 1, 9, 5], dtype=torch.int32)
    batched = torch.full((6, 9, 32), float("nan"), dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    for expert, count in enumerate(counts.tolist()):
        batched[expert, :count] = torch.randn(count, 32, generator=gen).to(dtype)
    with torch.no_grad():
        out = experts.apply_batched(batched, counts)
        for expert, count in enumerate(counts.tolist()):
            assert not out[expert, count:].any()
            rows = batched[expert, :count]
            ids, ones = torch.full((count, 1), expert, dtype=torch.long), torch.ones(count, 1)
            ref = experts.forward_native(rows, ids, ones)
            want = exact.forward_native(rows.double(), ids, ones.double())
            rounding = kernel_calls.down_rounding(exact, rows, ids, ones, dtype)
            check(out[expert, :count], ref, want, dtype, rounding)
    assert kernel_calls == ["fused_moe_batched"]


def test_kernel_refuses_a_local_id_beyond_the_experts(kernel_calls):
    experts, _ = make_experts(torch.float32)
    ids = torch.tensor([[0, 6]])
    with torch.no_grad(), pytest.raises(ValueError, match="local expert id 6 >= num_local_experts"):
        experts(torch.randn(1, 32), ids, torch.ones(1, 2))
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"counts in \[0, 2\]"),
    ):
        experts.apply_batched(torch.randn(6, 2, 32), torch.tensor([0, 0, 3, 0, 0, 0]))


def test_kernel_refuses_weights_not_packed_for_it(kernel_calls):
    experts, _ = make_experts(torch.float32)
    module = kernels_host.cpu_kernels("any")
    x, out = torch.randn(2, 32), torch.empty(2, 32)
    ids, weights = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    w13 = cpu_experts.pack_weights(torch.cat([experts.w1, experts.w3], 1), module)
    w2 = experts.w2
    with pytest.raises(RuntimeError, match="packed"):
        module.fused_moe(out, x, w13, w2.detach(), ids, weights)
    with pytest.raises(RuntimeError, match="dtype"):
        module.fused_moe(out, x, w13.double(), cpu_experts.pack_weights(w2, module), ids, weights)
    if kernel_calls.k_group == 2:  # this build takes bfloat16 weights in pairs of k only
        bf16 = [w.bfloat16() for w in (w13, cpu_experts.pack_weights(w2, module))]
        with pytest.raises(RuntimeError, match=r"K / 2, 16, 2\]"):
            module.fused_moe(out.bfloat16(), x.bfloat16(), *bf16, ids, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_result_does_not_depend_on_the_thread_count(kernel_calls, dtype):
    experts, _ = make_experts(dtype, num_experts=3, hidden=1024, inter=64)
    gen = torch.Generator().manual_seed(6)
    ids, weights = torch.randint(0, 3, (17, 2), generator=gen), torch.rand(17, 2, generator=gen)
    x = torch.randn(17, 1024, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = experts(x, ids, weights)
            torch.set_num_threads(2)
            two = experts(x, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_kernel_follows_weights_reloaded_in_place(kernel_calls):
    """Weights changed in place: the forward leaves the stale packs alone (the torch paths run,
    the result is right) and never packs; the post-load hook packs again."""
    experts, _ = make_experts(torch.float32)
    ids, weights = routed(9, 2, 6)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        experts(x, ids, weights)
        experts.w2.mul_(-2.0)  # a checkpoint re-loaded in place
        exact = TorchExperts(num_local_experts=6, hidden_size=32, intermediate_size=24).double()
        exact.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
        want = exact.forward_native(x.double(), ids, weights.double())
        ref = experts.forward_native(x, ids, weights)
        check(experts(x, ids, weights), ref, want, torch.float32)
        assert kernel_calls == ["fused_moe"]
        experts.process_weights_after_loading()
        check(experts(x, ids, weights), ref, want, torch.float32)
    assert kernel_calls == ["fused_moe", "fused_moe"]


def test_where_the_kernel_does_not_serve_the_torch_paths_run(kernel_calls, monkeypatch):
    """Batches over the measured cut (rows per active expert: oneDNN for bfloat16, the grouped
    GEMMs for float32), a hidden size that is not a multiple of 16, and autograd through the
    weights take the torch paths."""
    monkeypatch.setattr(cpu_experts, "tuned_max_rows", lambda *_: 4.0)
    experts, _ = make_experts(torch.bfloat16)
    ids, weights = routed(40, 3, 6)
    x = torch.randn(40, 32).bfloat16()
    with torch.no_grad():
        experts(x[:8], ids[:8], weights[:8])  # 24 pairs over 6 experts: 4 rows each
        assert kernel_calls == ["fused_moe"]
        experts(x, ids, weights)  # 20 rows each
        assert kernel_calls == ["fused_moe"]
        f32, exact = make_experts(torch.float32)
        out = f32(x.float(), ids, weights)
        assert kernel_calls == ["fused_moe"] and f32.cpu_packs.weights.packed == ()  # no 2nd copy
        check(out, out, exact.forward_native(x.double(), ids, weights.double()), torch.float32)
    monkeypatch.setattr(cpu_experts, "tuned_max_rows", lambda *_: math.inf)
    odd, exact = make_experts(torch.float32, hidden=24, inter=24)
    with torch.no_grad():
        out = odd(torch.randn(5, 24), ids[:5], weights[:5])
    assert kernel_calls == ["fused_moe"] and odd.cpu_packs.kernel == ()
    f32, _ = make_experts(torch.float32)
    f32.w2.requires_grad_(True)
    f32(torch.randn(5, 32), ids[:5], weights[:5])  # grad enabled: the oneDNN / grouped path
    assert kernel_calls == ["fused_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_take_the_cut_measured_on_both_paths(tuning_file, kernel_calls, monkeypatch, dtype):
    """Loading experts measures the kernel against the torch path on this machine (both run)
    and keeps the answer, one of 0, 1, 2, 4, ... or inf, for their dtype and shape."""
    monkeypatch.setattr(cpu_experts, "tuned_max_rows", tuning.tuned_max_rows)
    experts, _ = make_experts(dtype)
    max_rows = experts.cpu_packs.kernel_max_rows
    assert max_rows == math.inf or max_rows == 0 or math.log2(max_rows).is_integer()
    assert "fused_moe" in kernel_calls
    ((key, stored),) = json.loads(tuning_file.read_text()).items()
    assert key.startswith(f"experts {dtype} H=32 F=24 threads=") and stored == max_rows
    kernel_calls.clear()
    again, _ = make_experts(dtype, seed=3)  # the same shape: not measured again
    assert again.cpu_packs.kernel_max_rows == max_rows and kernel_calls == []
