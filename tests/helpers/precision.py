"""Tolerances of the logit comparisons, derived from each dtype's precision, and the reference.

Exactness is checked in float64 against transformers' float64 build of the same checkpoint (and
DBO on against off): float64 rounding is ~1e-16 relative, so 1e-9 of the largest |logit| leaves a
margin of 10^6 for summation order (GEMM shapes, CPUs) and still catches any real difference.
transformers keeps some float32 steps in a float64 model (RMSNorm statistics, router softmax,
RoPE tables); ours does the same steps in float32 too, so their inputs, equal to ~1e-16, round to
the same float32 values. One exception: transformers' DeepSeek-V2 rotates q/k in complex64, ours
in the model dtype, so that comparison is bounded by float32 rounding: 2**-17 (~64 float32 ulps)
of the largest |logit| (measured: 2e-7). On a CUDA device every model's float32 steps run in
CUDA's math library (its exp, rsqrt, sin and pow round differently from the host's by an ulp or
two), so a GPU's float64 logits against the host's reference are bounded by the same 2**-17
(measured on an H200: 2.2e-7 to 3.3e-7 of the largest |logit|); DBO on against off, both on the
GPU, stays exact.

float32 results are compared with the float64 reference at 2**-14 (~512 float32 ulps) of the
largest |logit|: summation-order rounding measured 3e-7 to 8e-7 relative on one rank here, ~3e-6
on two ranks on an AMD EPYC with avx512 (where a 1e-5 absolute bound failed); a real error (a wrong
weight, mask or route) is orders of magnitude larger. Bugs too small for that bound are the float64
tests' job.
"""

from __future__ import annotations

import torch

FLOAT64_REL = 1e-9
FLOAT32_ISLAND_REL = 2**-17  # transformers' complex64 RoPE in DeepSeek-V2
FLOAT32_REL = 2**-14


def reference_model(path, dtype: torch.dtype = torch.float64):
    """transformers' model of checkpoint ``path`` in ``dtype``, experts on the eager loop
    (``torch._grouped_mm``, transformers' default, takes no float64)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, experts_implementation="eager"
    ).eval()


def reference_rel(model_type: str, device_type: str = "cpu") -> float:
    """Relative bound of our float64 logits, computed on a ``device_type`` device, against
    transformers' float64 ones computed on the host."""
    if model_type == "deepseek_v2" or device_type == "cuda":
        return FLOAT32_ISLAND_REL
    return FLOAT64_REL


def assert_logits_close(actual, expected, *, rel: float, msg=None) -> None:
    """|actual - expected| <= rel * max|expected| elementwise (``actual`` cast to expected's dtype).

    Raises:
        AssertionError: from ``torch.testing.assert_close``, with ``msg`` if given.
    """
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    atol = rel * float(expected.abs().max())
    torch.testing.assert_close(actual.to(expected.dtype), expected, rtol=0, atol=atol, msg=msg)
