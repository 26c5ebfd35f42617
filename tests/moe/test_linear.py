"""Linear (prepacked oneDNN weight on CPU) and the experts' prepacked bfloat16 path, against their
forward_native references.

Tolerances: float64 runs ``F.linear`` on both paths (bit-identical). float32: both paths sum K
products in float32 in different orders; each is within the classic dot-product bound
K * 2**-24 * sum_k |x_k w_k| of the exact value (Higham, gamma_K), so they differ by at most twice
that. bfloat16: both paths accumulate in float32 (far below a bf16 ulp) and round each output
once to bfloat16, so an output can differ by one bf16 ulp: 2**-7 of its magnitude (8 significant
bits); the bound is 2**-7 of the largest |output| (experts: the existing 2**-6 for bf16 and 1e-6
for float32, ``tests/moe/test_custom_op.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from moe import TorchExperts, set_custom_ops
from moe.layers import linear as linear_mod
from moe.layers.linear import Linear, padded_num_rows, process_weights_after_loading
from tests.helpers.capability import needs_onednn, onednn_dtypes

BF16_LINEAR_REL = 2**-7
BF16_EXPERTS_TOL = 2**-6
FLOAT32_EXPERTS_TOL = 1e-6


@pytest.fixture(autouse=True)
def _restore_custom_ops():
    yield
    set_custom_ops("all")


@pytest.fixture(autouse=True)
def _pack_small_float32(monkeypatch):
    """The tests' weights are small; let float32 pack them anyway (the size threshold is a speed
    policy, tested on its own below; the kernels are what these tests check)."""
    monkeypatch.setattr(linear_mod, "FLOAT32_MIN_PACKED_ELEMENTS", 0)


@pytest.fixture(autouse=True)
def _experts_on_onednn(monkeypatch):
    """The experts' tests here check the per-expert oneDNN and upcast paths, which run where our
    compiled kernel does not (bfloat16 prefill, no compiler): the kernel is off here and has its
    own tests (``tests/moe/test_fused_moe_kernel.py``)."""
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")


@pytest.fixture(autouse=True)
def _no_bfloat16_upcast(monkeypatch):
    """The tests' bfloat16 weights are small enough for the float32 upcast; keep them on the
    oneDNN kernels (the upcast has its own tests below)."""
    monkeypatch.setattr(linear_mod, "BFLOAT16_UPCAST_MAX_ELEMENTS", 0)


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` so every call appends 1 to the returned list."""
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _linear(dtype, *, bias, seed=0, in_features=48, out_features=40) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    process_weights_after_loading(layer)
    return layer


def _assert_equal_to_native(layer: Linear, x: torch.Tensor) -> None:
    with torch.no_grad():
        fast, ref = layer(x), layer.forward_native(x)
    assert fast.shape == ref.shape and fast.dtype == ref.dtype
    if x.dtype == torch.bfloat16:
        atol = BF16_LINEAR_REL * float(ref.abs().max()) if ref.numel() else 0.0
        torch.testing.assert_close(fast.float(), ref.float(), rtol=0, atol=atol)
    elif x.dtype == torch.float32:
        abs_sum = x.double().abs() @ layer.weight.double().abs().T  # sum_k |x_k w_k|
        bound = 2 * layer.in_features * 2**-24 * abs_sum
        assert ((fast.double() - ref.double()).abs() <= bound).all()
    else:
        assert torch.equal(fast, ref)


def test_padded_num_rows_hand_worked():
    rows = (1, 7, 16, 17, 20, 21, 33, 100, 129, 255, 256, 257, 577, 2000, 2049)
    got = [padded_num_rows(n) for n in rows]
    # 1/8-octave steps below 256 rows, 1/64-octave (at least 16) from 256 on
    assert got == [1, 7, 16, 20, 20, 24, 40, 112, 160, 256, 256, 272, 592, 2016, 2112]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [0, 1, 7, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cpu_path_equals_native(dtype, num_rows, bias):
    layer = _linear(dtype, bias=bias)
    assert layer.forward_path == "forward_cpu"
    x = torch.randn(num_rows, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    _assert_equal_to_native(layer, x)
    _assert_equal_to_native(layer, x.reshape(1, num_rows, 48))  # leading dims kept
    with torch.no_grad():
        is_packed = layer.packed_weight() is not None
    expect = dtype != torch.float64 and linear_mod.packing_unavailable_reason(dtype) is None
    assert is_packed == expect


def test_float32_batches_above_the_threshold_take_f_linear(monkeypatch):
    monkeypatch.setattr(linear_mod, "FLOAT32_MAX_PACKED_ROWS", 256)  # the Intel threshold
    layer = _linear(torch.float32, bias=True)
    x = torch.randn(linear_mod.FLOAT32_MAX_PACKED_ROWS + 1, 48)
    with torch.no_grad():
        assert torch.equal(layer(x), layer.forward_native(x))


@pytest.mark.parametrize("dtype", onednn_dtypes(torch.float32, torch.bfloat16))
def test_linear_repacks_weights_written_after_packing(dtype):
    layer = _linear(dtype, bias=True)
    x = torch.randn(17, 48).to(dtype)
    with torch.no_grad():
        before = layer(x)
        old_pack = layer.packed_weight()
        layer.weight.copy_(torch.randn(40, 48) * 0.3)  # a checkpoint re-loaded in place
        layer.bias.copy_(torch.randn(40))
    _assert_equal_to_native(layer, x)
    with torch.no_grad():
        assert layer.packed_weight() is not old_pack
        assert not torch.equal(layer(x), before)


def test_custom_ops_none_runs_f_linear():
    set_custom_ops("none")
    layer = _linear(torch.bfloat16, bias=False)
    assert layer.forward_path == "forward_native"
    x = torch.randn(5, 48).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))


@needs_onednn(torch.bfloat16)
def test_traced_linear_uses_the_weight_it_is_given():
    """Graph mode traces a piece once and calls the graph with each layer's weights: the trace
    must hold F.linear on its weight input, never one layer's pack as a constant."""
    layer = _linear(torch.bfloat16, bias=False)
    other = torch.randn(40, 48).bfloat16()
    x = torch.randn(3, 48).bfloat16()

    def fn(weight, inputs):
        return torch.func.functional_call(layer, {"weight": weight}, (inputs,))

    with torch.no_grad():
        graph = make_fx(fn)(layer.weight, x)
        assert "mkldnn" not in str(graph.code)
        assert torch.equal(graph(other, x), F.linear(x, other))


def test_linear_falls_back_with_a_logged_reason(monkeypatch, caplog):
    reason = "this torch has no torch.ops.mkldnn._linear_pointwise (test)"
    monkeypatch.setattr(linear_mod, "packing_unavailable_reason", lambda dtype: reason)
    with caplog.at_level(logging.WARNING, logger="moe.layers.linear"):
        layer = _linear(torch.bfloat16, bias=True)
    assert reason in caplog.text
    x = torch.randn(17, 48).bfloat16()
    with torch.no_grad():
        assert layer.packed_weight() is None
        assert torch.equal(layer(x), layer.forward_native(x))


def test_linear_keeps_nn_linear_names_and_default_init():
    layer = Linear(8, 4, bias=True)
    assert dict(layer.named_parameters()).keys() == {"weight", "bias"}
    assert layer.weight.abs().max() <= 8**-0.5  # kaiming_uniform(a=sqrt(5)) bound 1/sqrt(fan_in)


def _experts(dtype, seed=0) -> TorchExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = TorchExperts(num_local_experts=6, hidden_size=32, intermediate_size=24, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    process_weights_after_loading(experts)
    return experts


@pytest.mark.parametrize("dtype", onednn_dtypes(torch.float32, torch.bfloat16))
@pytest.mark.parametrize("num_tokens", [0, 1, 17, 40])
def test_packed_experts_equal_native_and_follow_reloads(dtype, num_tokens):
    experts = _experts(dtype)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(-1, 4, (num_tokens, 2), generator=gen)  # experts 4, 5 get nothing
    weights = torch.rand(num_tokens, 2, generator=gen)
    x = torch.randn(num_tokens, 32, generator=gen).to(dtype)
    tol = BF16_EXPERTS_TOL if dtype == torch.bfloat16 else FLOAT32_EXPERTS_TOL
    with torch.no_grad():
        assert len(experts.packed_weights()) == 2 * 6
        for _ in range(2):  # before and after the weights are re-loaded in place
            fast, ref = experts(x, ids, weights), experts.forward_native(x, ids, weights)
            torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)
            experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.3)
            experts.process_weights_after_loading()  # the loader's hook: packs again


@pytest.mark.parametrize("dtype", onednn_dtypes(torch.float32, torch.bfloat16))
def test_batched_experts_run_the_packed_gemms_and_equal_native(monkeypatch, dtype):
    """``apply_batched`` (DeepEP low-latency layout ``[E, M, H]`` + counts, unweighted) runs every
    expert with rows on the oneDNN packs, equals the reference's per-expert SwiGLU within the
    dtype's bound, and leaves the rows past each count zero (garbage in, NaN, ignored)."""
    from moe.fused_moe import cpu_experts as experts_mod

    calls = []

    def counting_onednn_linear(x, packed, bias=None):
        calls.append(x.shape[0])
        return linear_mod.onednn_linear(x, packed, bias)

    monkeypatch.setattr(experts_mod, "onednn_linear", counting_onednn_linear)
    experts = _experts(dtype)
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 9, 1, 9, 5], dtype=torch.int32)
    batched = torch.full((6, 9, 32), float("nan"), dtype=dtype)
    for expert, count in enumerate(counts.tolist()):
        batched[expert, :count] = torch.randn(count, 32, generator=gen).to(dtype)
    exact = TorchExperts(num_local_experts=6, hidden_size=32, intermediate_size=24).double()
    set_custom_ops("none")
    plain = TorchExperts(num_local_experts=6, hidden_size=32, intermediate_size=24, dtype=dtype)
    set_custom_ops("all")
    with torch.no_grad():
        exact.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
        plain.load_state_dict(experts.state_dict())
        out = experts.apply_batched(batched, counts)
        assert sorted(calls) == sorted(2 * [n for n in counts.tolist() if n])  # gate_up, down
        calls.clear()
        plain_out = plain.apply_batched(batched, counts)
        for expert, count in enumerate(counts.tolist()):
            assert not out[expert, count:].any() and not plain_out[expert, count:].any()
            if count == 0:
                continue
            rows = batched[expert, :count]
            ids, ones = torch.full((count, 1), expert, dtype=torch.long), torch.ones(count, 1)
            ref = experts.forward_native(rows, ids, ones)
            assert torch.equal(plain_out[expert, :count], ref)  # same GEMMs, weight 1 exact
            ref = ref.double()
            if dtype == torch.bfloat16:  # as the weighted experts: the bfloat16 reference's bound
                torch.testing.assert_close(
                    out[expert, :count].double(), ref, atol=BF16_EXPERTS_TOL, rtol=BF16_EXPERTS_TOL
                )
                continue
            # float32: within 4x the float32 reference's own error against the exact result
            ref64 = exact.forward_native(rows.double(), ids, ones.double())
            tol = 4 * float((ref - ref64).abs().max()) + FLOAT32_EXPERTS_TOL
            torch.testing.assert_close(out[expert, :count].double(), ref64, atol=tol, rtol=0)
        assert calls == []  # the reference path (custom ops off) runs the plain GEMMs
        assert not plain_out.isnan().any()


@needs_onednn(torch.float32)
def test_float32_experts_above_the_row_threshold_take_the_plain_gemms(monkeypatch):
    """An expert with more than FLOAT32_MAX_PACKED_ROWS rows runs the reference's own GEMMs (bit
    for bit when every token goes there); beside packed experts the result stays within the
    float32 bound of the reference."""
    monkeypatch.setattr(linear_mod, "FLOAT32_MAX_PACKED_ROWS", 256)  # the Intel threshold
    experts = _experts(torch.float32)
    gen = torch.Generator().manual_seed(3)
    num_tokens = linear_mod.FLOAT32_MAX_PACKED_ROWS + 9
    x = torch.randn(num_tokens, 32, generator=gen)
    with torch.no_grad():
        assert experts.packed_weights()
        ids, weights = torch.zeros(num_tokens, 1, dtype=torch.long), torch.rand(num_tokens, 1)
        assert torch.equal(experts(x, ids, weights), experts.forward_native(x, ids, weights))
        ids = torch.cat((ids, torch.randint(1, 6, (num_tokens, 1), generator=gen)), dim=1)
        weights = torch.rand(num_tokens, 2, generator=gen)
        fast, ref = experts(x, ids, weights), experts.forward_native(x, ids, weights)
        torch.testing.assert_close(fast, ref, atol=FLOAT32_EXPERTS_TOL, rtol=FLOAT32_EXPERTS_TOL)


def test_float64_experts_are_not_packed():
    with torch.no_grad():
        assert _experts(torch.float64).packed_weights() == ()


@needs_onednn(torch.float32)
@needs_onednn(torch.bfloat16)
def test_small_float32_weights_stay_on_f_linear(monkeypatch):
    monkeypatch.setattr(linear_mod, "FLOAT32_MIN_PACKED_ELEMENTS", 48 * 40 + 1)
    layer = _linear(torch.float32, bias=False)
    x = torch.randn(5, 48)
    with torch.no_grad():
        assert layer.packed_weight() is None
        assert torch.equal(layer(x), layer.forward_native(x))
        assert _experts(torch.float32).packed_weights() == ()  # 32 x 24 per expert
        assert _experts(torch.bfloat16).packed_weights() != ()  # bfloat16 packs any size


@needs_onednn(torch.bfloat16)
@pytest.mark.parametrize("bias", [False, True])
def test_small_bfloat16_linear_runs_in_float32_within_one_ulp(monkeypatch, bias):
    """A small bfloat16 weight keeps an exact float32 copy; batches up to
    BFLOAT16_UPCAST_MAX_MACS run F.linear in float32 on it (one rounding to bfloat16), larger
    ones the oneDNN pack; both within the bfloat16 bound of the reference; a reload re-makes it."""
    monkeypatch.setattr(linear_mod, "BFLOAT16_UPCAST_MAX_ELEMENTS", 48 * 40)
    monkeypatch.setattr(linear_mod, "BFLOAT16_UPCAST_MAX_MACS", 17 * 48 * 40)
    calls = _count_calls(monkeypatch, linear_mod, "upcast_linear")
    layer = _linear(torch.bfloat16, bias=bias)
    with torch.no_grad():
        assert torch.equal(layer.upcast_weight(), layer.weight.float())
    for num_rows, upcast in ((1, 1), (17, 1), (18, 0)):
        x = torch.randn(num_rows, 48, generator=torch.Generator().manual_seed(num_rows))
        calls.clear()
        _assert_equal_to_native(layer, x.bfloat16())
        assert len(calls) == upcast
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 48) * 0.3)  # a checkpoint re-loaded in place
        assert torch.equal(layer.upcast_weight(), layer.weight.float())
    _assert_equal_to_native(layer, torch.randn(5, 48).bfloat16())
    monkeypatch.setattr(linear_mod, "BFLOAT16_UPCAST_MAX_ELEMENTS", 48 * 40 - 1)
    with torch.no_grad():
        assert _linear(torch.bfloat16, bias=bias).upcast_weight() is None  # too big: none kept


@pytest.mark.parametrize("num_tokens", [1, 17, 40])
@pytest.mark.parametrize("has_pack", [True, False])
def test_small_bfloat16_experts_run_in_float32_and_follow_reloads(
    monkeypatch, num_tokens, has_pack
):
    """Small bfloat16 experts run their GEMMs in float32 on exact float32 copies (a batch above
    BFLOAT16_UPCAST_MAX_MACS rows x weight takes the oneDNN pack, or the plain GEMMs where oneDNN
    cannot pack bfloat16: the copies need no oneDNN), within the bfloat16 bound."""
    from moe.fused_moe import cpu_experts as experts_mod

    monkeypatch.setattr(linear_mod, "BFLOAT16_UPCAST_MAX_ELEMENTS", 2 * 32 * 24)
    monkeypatch.setattr(linear_mod, "BFLOAT16_UPCAST_MAX_MACS", 12 * 2 * 32 * 24)
    calls = _count_calls(monkeypatch, experts_mod, "upcast_linear")
    if not has_pack:  # as on a CPU without bfloat16 GEMMs (AVX2)
        monkeypatch.setattr(linear_mod, "packing_unavailable_reason", lambda dtype: "test")
    elif linear_mod.packing_unavailable_reason(torch.bfloat16) is not None:
        pytest.skip(
            f"no oneDNN bfloat16 pack: {linear_mod.packing_unavailable_reason(torch.bfloat16)}"
        )
    experts = _experts(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(-1, 4, (num_tokens, 2), generator=gen)
    weights = torch.rand(num_tokens, 2, generator=gen)
    x = torch.randn(num_tokens, 32, generator=gen).bfloat16()
    with torch.no_grad():
        for _ in range(2):  # before and after the weights are re-loaded in place
            calls.clear()
            fast, ref = experts(x, ids, weights), experts.forward_native(x, ids, weights)
            torch.testing.assert_close(
                fast.float(), ref.float(), atol=BF16_EXPERTS_TOL, rtol=BF16_EXPERTS_TOL
            )
            assert calls  # every expert with <= 12 rows (down: <= 24) runs in float32
            experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.3)
            assert experts.packed_weights() == ()  # stale: a forward does not re-pack
            experts.process_weights_after_loading()  # the loader's hook: packs and copies again
        assert (experts.packed_weights() != ()) == has_pack
        assert torch.equal(experts.cpu_packs.upcast[1], experts.w2[0].float())
