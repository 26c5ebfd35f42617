"""CustomOp: the custom-ops setting, per-platform dispatch, out-of-tree replacement, entry-point
plugins, and every CPU fast path against its forward_native reference."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from moe import CustomOp, RMSNorm, RotaryEmbedding, TorchExperts, set_custom_ops
from moe.fused_moe import cpu_experts
from moe.layers.norm import rows_per_cache_block
from moe.platforms import plugins
from moe.platforms.custom_op import parse_custom_ops
from moe.platforms.interface import CpuPlatform, CudaPlatform, Platform
from moe.platforms.plugins import (
    current_platform,
    load_general_plugins,
    resolve_platform,
    set_current_platform,
)


@pytest.fixture(autouse=True)
def _restore_global_state():
    yield
    set_custom_ops("all")
    set_current_platform(None)
    CustomOp.op_registry_oot.clear()


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("all,none", r"cannot contain both 'all' and 'none'"),
        ("rms_norm", r"entry 'rms_norm' is not valid"),
        ("all,,+experts", r"entry '' is not valid"),
        ("+experts,-experts", r"enables and disables the same op\(s\): \['experts'\]"),
    ],
)
def test_bad_custom_ops_settings(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_custom_ops(spec)


def test_unknown_op_name_lists_registered_ops():
    with pytest.raises(
        ValueError, match=r"unknown op\(s\) \['nope'\]; registered ops: \[.*'experts'"
    ):
        set_custom_ops("all,-nope")


def _experts():
    return TorchExperts(num_local_experts=2, hidden_size=4, intermediate_size=6)


@pytest.mark.parametrize(
    ("spec", "experts_path", "rope_path"),
    [
        ("all", "forward_cpu", "forward_cpu"),
        ("none", "forward_native", "forward_native"),
        ("none,+experts", "forward_cpu", "forward_native"),
        ("all,-rotary_embedding", "forward_cpu", "forward_native"),
    ],
)
def test_setting_chooses_paths_at_build(spec, experts_path, rope_path):
    set_current_platform(CpuPlatform())
    set_custom_ops(spec)
    assert _experts().forward_path == experts_path
    assert RotaryEmbedding(4, 1e4).forward_path == rope_path
    norm_path = "forward_native" if spec.startswith("none") else "forward_cpu"
    assert RMSNorm(4).forward_path == norm_path


@pytest.mark.parametrize("hidden_size", [64, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_cpu_path_equals_reference(dtype, hidden_size):
    """float32 takes the fused F.rms_norm (within 1e-6, the fast-path bound; bit-identical where
    measured); bfloat16 takes F.rms_norm without weight, then the weight. Its bound: both paths
    take the statistics in float32, so they can differ only where a different float32 summation
    order flips the rounding of the normalised value to bfloat16 (one bf16 ulp, <= 2^-7 of it);
    the weight's multiply rounds once more, so <= 2^-6 of |output| (bit-identical where measured).
    float64 takes the reference itself."""
    set_current_platform(CpuPlatform())
    norm = RMSNorm(hidden_size, 1e-5, dtype=dtype)
    assert norm.forward_path == "forward_cpu"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden_size, generator=gen) * 0.3 + 1)
    x = (torch.randn(301, hidden_size, generator=gen) * 5).to(dtype)
    got, expected = norm(x), norm.forward_native(x)
    # 301 rows take the blocked path at hidden 1024 (64-row blocks), one call at hidden 64
    assert (rows_per_cache_block(hidden_size) < 301) == (hidden_size == 1024)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    elif dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=2**-6, atol=0)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_blocks_equal_one_call(dtype):
    """The blocked path (rows in cache-sized blocks, a 3-d input, a last partial block) equals
    one unblocked call bit for bit: every row's arithmetic is the same."""
    set_current_platform(CpuPlatform())
    hidden_size = 512
    norm = RMSNorm(hidden_size, 1e-5, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden_size, generator=gen) * 0.3 + 1)
    block = rows_per_cache_block(hidden_size)
    x = (torch.randn(3, block + 5, hidden_size, generator=gen) * 5).to(dtype)
    one_call = norm._normalize(x, dtype == torch.float32)
    got = norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, one_call)


def test_dispatch_follows_platform():
    @CustomOp.register("test_double")
    class Double(CustomOp):
        def forward_native(self, x):
            return 2 * x

        def forward_cuda(self, x):
            return x + x

    set_current_platform(CudaPlatform())
    assert Double().forward_path == "forward_cuda"
    set_current_platform(CpuPlatform())
    assert Double().forward_path == "forward_native"  # no forward_cpu: the reference
    del CustomOp.op_registry["test_double"]


def test_out_of_tree_op_replaces_class_by_name():
    class NPUPlatform(Platform):
        name, dispatch_key = "npu", "oot"

    @CustomOp.register_oot("RMSNorm")
    class NPURMSNorm(RMSNorm):
        def forward_oot(self, x):
            return torch.full_like(x, 7.0)

    set_current_platform(NPUPlatform())
    norm = RMSNorm(4, 1e-6)
    assert type(norm) is NPURMSNorm and norm.forward_path == "forward_oot"
    assert norm(torch.ones(2, 4)).eq(7.0).all()
    set_custom_ops("all,-rms_norm")  # disabling by op name still reaches the reference
    norm = RMSNorm(4)
    assert norm.forward_path == "forward_native"
    torch.testing.assert_close(norm(torch.ones(2, 4)), torch.ones(2, 4))


def test_platform_and_general_plugins_found_through_entry_points(tmp_path, monkeypatch):
    (tmp_path / "fake_npu_plugin.py").write_text(
        textwrap.dedent(
            """
            from moe.platforms import CustomOp
            from moe.layers import SiluAndMul
            from moe.platforms import Platform

            class FakeNPU(Platform):
                name, dispatch_key = "fake_npu", "oot"

            class FakeSiluAndMul(SiluAndMul):
                def forward_oot(self, gate, up):
                    return gate * 0 + 3

            def register_platform():
                return "fake_npu_plugin.FakeNPU"

            def register_ops():
                CustomOp.register_oot("SiluAndMul", op_cls=FakeSiluAndMul)
            """
        )
    )
    dist_info = tmp_path / "fake_npu_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-npu-plugin\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[moe_dbo.platform_plugins]\nfake_npu = fake_npu_plugin:register_platform\n\n"
        "[moe_dbo.general_plugins]\nfake_ops = fake_npu_plugin:register_ops\n"
    )
    monkeypatch.delenv("MOE_DBO_PLATFORM", raising=False)  # the suite pins the CPU platform
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_general_plugins_loaded", False)
    set_current_platform(resolve_platform())
    assert current_platform().name == "fake_npu"
    load_general_plugins()
    from moe.layers.activation import SiluAndMul

    op = SiluAndMul()
    assert type(op).__name__ == "FakeSiluAndMul" and op.forward_path == "forward_oot"
    assert op(torch.zeros(2), torch.zeros(2)).eq(3).all()
    sys.modules.pop("fake_npu_plugin", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_experts_equal_the_reference_loop(monkeypatch, dtype):
    """forward_cpu (packed oneDNN or grouped GEMM; the compiled kernel off: it has its own tests in
    tests/moe/test_fused_moe_kernel.py) and cpu_experts.forward_grouped vs forward_native (the
    per-expert loop), with slots routed to other ranks (-1) and experts that receive no token.
    float32: 1e-6 (same products, other blocking); bfloat16: 1 ulp of the output magnitude (~2,
    so 2**-6) since each path rounds its GEMMs."""
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")
    set_custom_ops("all")
    gen = torch.Generator().manual_seed(0)
    experts = TorchExperts(num_local_experts=6, hidden_size=32, intermediate_size=24, dtype=dtype)
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ids = torch.randint(-1, 4, (40, 3), generator=gen)  # experts 4 and 5 get nothing
    weights = torch.rand(40, 3, generator=gen)
    x = torch.randn(40, 32, generator=gen).to(dtype)
    assert experts.forward_path == "forward_cpu"
    with torch.no_grad():
        fast, ref = experts(x, ids, weights), experts.forward_native(x, ids, weights)
        # bf16 forward_cpu takes the packs (where made)
        grouped = cpu_experts.forward_grouped(experts, x, ids, weights)
    tol = 1e-6 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(grouped.float(), ref.float(), atol=tol, rtol=tol)
    assert ref[(ids == -1).all(dim=1)].eq(0).all()
    empty = experts(x[:0], ids[:0], weights[:0])
    assert empty.shape == (0, 32)
    none_local = experts(x, torch.full_like(ids, -1), weights)
    assert none_local.eq(0).all()


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("scaling", [None, {"factor": 4.0, "original_max_position_embeddings": 32}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cached_rope_equals_reference(is_neox_style, scaling, dtype):
    """The table path (per-dtype factors: [cos, cos, -sin, sin] for neox style, pairs for
    interleaved) is bit-identical to the reference in every dtype: ``forward_cpu`` and
    ``forward_cuda`` (the table path without the host's bound check)."""
    rope = RotaryEmbedding(
        8, 1e4, is_neox_style=is_neox_style, scaling=scaling, max_position_embeddings=128
    )
    positions = torch.tensor([0, 5, 127, 64, 3])
    q, k = torch.randn(5, 4, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    reference = rope.forward_native(positions, q, k)
    for forward in (rope.forward_cpu, rope.forward_cuda):
        for a, b in zip(forward(positions, q, k), reference, strict=True):
            assert torch.equal(a, b)
    beyond = torch.tensor([200])  # past the table: falls back to computing cos/sin
    for a, b in zip(
        rope.forward_cpu(beyond, q[:1], k[:1]),
        rope.forward_native(beyond, q[:1], k[:1]),
        strict=True,
    ):
        assert torch.equal(a, b)
