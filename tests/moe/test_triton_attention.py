"""TRITON_ATTN (``moe.layers.triton_attention``) on CPU tensors in Triton's interpreter: the
kernels equal ``forward_native`` (GQA and MLA, float64, float32, bfloat16; decodes, prefill chunks,
mixed batches, a request with no query row, padding rows, contexts off the block size, GQA ratios
1, 4 and 6, head_dim 64 and 128, MLA's 512 + 64 latent), and the CUDA platform picks the backend
where Triton can launch. The interpreter runs in a subprocess: Triton reads ``TRITON_INTERPRET``
when it is imported (``tests.helpers.triton_interpreter``). Speed and the compiled kernel are a
GPU's to check (``tests/launch/test_gpu.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="TRITON_ATTN needs Triton (not installed)")

from moe.layers import triton_attention  # noqa: E402
from moe.platforms import CpuPlatform, CudaPlatform  # noqa: E402
from tests.helpers.triton_interpreter import run_interpreted  # noqa: E402

CASES = "tests.moe.triton_attention_cases"


DTYPES = ("float64", "float32", "bfloat16")


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_kernel_equals_forward_native(case):
    output = run_interpreted(CASES, case, *DTYPES, timeout_s=600)
    for dtype in DTYPES:  # every check ran and printed its error bound
        assert f"{case} mixed" in output and f"{case} decode" in output and dtype in output


def test_cuda_platform_lists_triton_first_where_it_launches(monkeypatch):
    monkeypatch.setattr(triton_attention, "triton_unavailable_reason", lambda: None)
    assert CudaPlatform().attention_backends[0] == "TRITON_ATTN"
    assert "TRITON_ATTN" not in CpuPlatform().attention_backends
    reason = "no CUDA device (and Triton's interpreter is off)"
    monkeypatch.setattr(triton_attention, "triton_unavailable_reason", lambda: reason)
    assert CudaPlatform().attention_backends == ("TORCH_SDPA", "FLEX_ATTENTION")
