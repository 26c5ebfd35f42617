"""``RMSNorm.forward_cuda``: one Triton launch (``moe.layers.triton_norm``) equal to
``forward_native`` (float32, float16, bfloat16; a bfloat16 input with a float32 weight; float64
takes ``forward_native`` itself;
3-D inputs, strided rows, widths off a power of 2 and below the kernel's block, no rows), run on
CPU tensors in Triton's interpreter in a subprocess (``tests.helpers.triton_interpreter``); the
torch form where Triton cannot launch and while a graph is traced."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the Triton RMSNorm needs Triton (not installed)")

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from moe.layers import triton_attention, triton_norm  # noqa: E402
from moe.layers.norm import RMSNorm  # noqa: E402
from moe.platforms import CudaPlatform, set_current_platform, triton_probe  # noqa: E402
from tests.helpers.op_count import count_ops  # noqa: E402
from tests.helpers.triton_interpreter import compile_for_sm90, run_interpreted  # noqa: E402

CASES = "tests.moe.triton_norm_cases"
DTYPES = ("float64", "float32", "float16", "bfloat16")


def test_kernel_equals_forward_native():
    output = run_interpreted(CASES, *DTYPES, timeout_s=300)
    for dtype in DTYPES:  # every check ran and printed its error bound
        for name in ("rows", "3-D", "strided view", "narrow", "empty"):
            assert f"{name} torch.{dtype} weight torch.{dtype}: max error" in output
    assert "weight torch.float32" in output.split("torch.bfloat16", 1)[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernel_equals_forward_native_on_a_gpu():
    """The same checks on CUDA tensors, the kernel compiled."""
    output = run_interpreted(CASES, *DTYPES, "--device", "cuda", timeout_s=300, env={})
    assert "empty torch.bfloat16 weight torch.float32" in output


def test_kernel_compiles_for_sm90(monkeypatch):
    """What a Hopper GPU would launch compiles for sm90 without one (Triton's NVIDIA backend down
    to ptxas): bfloat16 at DeepSeek's hidden 7168 (8 warps) and with a float32 weight, float32
    at 2048, float16 at a head's 128."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    from triton import knobs

    if knobs.runtime.interpret:
        pytest.skip("Triton was imported under TRITON_INTERPRET=1: its kernels are interpreted")
    compiled: list[str] = []
    monkeypatch.setattr(triton_attention, "launch", compile_for_sm90(compiled))
    cases = [
        (torch.bfloat16, torch.bfloat16, 7168),
        (torch.bfloat16, torch.float32, 7168),
        (torch.float32, torch.float32, 2048),
        (torch.float16, torch.float16, 128),
    ]
    for dtype, weight_dtype, hidden_size in cases:
        x = torch.zeros(4, hidden_size, dtype=dtype)
        triton_norm.triton_rms_norm(x, torch.ones(hidden_size, dtype=weight_dtype), 1e-6)
    assert compiled == ["rms_norm_kernel"] * len(cases)


@pytest.fixture
def cuda_norm(monkeypatch):
    """An RMSNorm bound to ``forward_cuda`` on CPU tensors, its launches recorded (not run)."""
    launches = []
    monkeypatch.setattr(
        triton_attention, "launch", lambda kernel, grid, **kw: launches.append(grid)
    )
    set_current_platform(CudaPlatform())
    try:
        norm = RMSNorm(64, eps=1e-5)
    finally:
        set_current_platform(None)
    assert norm.forward_path == "forward_cuda"
    return norm, launches


def test_torch_form_where_triton_cannot_launch(cuda_norm, monkeypatch):
    """No CUDA device and no interpreter (this process); Triton launching but x on the host while
    the interpreter is off (the CUDA op paths on CPU tensors of a GPU machine). (float64:
    ``triton_norm_cases``, no launch under the interpreter either.)"""
    norm, launches = cuda_norm
    x = torch.randn(5, 64)
    assert triton_probe.triton_unavailable_reason() is not None
    assert not triton_norm.can_launch_rms_norm(x, norm.weight)
    assert torch.equal(norm(x), norm.forward_native(x))
    monkeypatch.setattr(triton_probe, "triton_unavailable_reason", lambda: None)
    assert not triton_norm.can_launch_rms_norm(x, norm.weight)
    assert torch.equal(norm(x), norm.forward_native(x))
    assert launches == []


def test_graph_traces_take_the_torch_form_and_op_counters_the_launch(cuda_norm, monkeypatch):
    """``make_fx`` cannot see into a launch: its graph holds the torch ops. A dispatch mode that
    only watches (an op counter) sees the launch: the output's allocation and nothing else."""
    norm, launches = cuda_norm
    monkeypatch.setattr(triton_norm, "can_launch_rms_norm", lambda x, weight: True)
    x = torch.randn(5, 64)
    for mode in ("fake", "real"):
        graph = make_fx(norm, tracing_mode=mode, _allow_non_fake_inputs=True)(x)
        assert "rsqrt" in graph.code and launches == []
    count = count_ops(lambda: norm(x))
    assert launches == [(5,)] and count.aten_ops == ("aten::empty",)
