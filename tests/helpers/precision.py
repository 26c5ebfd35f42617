"""Tolerances of the logit comparisons, derived from each dtype's precision, and the reference.

Exactness is checked in float64 against transformers' float64 build of the same checkpoint (and
DBO on against off): float64 rounding is ~1e-16 relative, so 1e-9 of the largest |logit| leaves a
margin of 10^6 for summation order (GEMM shapes, CPUs) and still catches any real difference.

transformers keeps some steps in float32 in a float64 model, and what they can contribute is what
bounds a comparison, on any CPU (``reference_rel`` is the one place that says it):
- elementwise steps and per-row reductions (RMSNorm statistics, the router softmax, RoPE tables):
  ours does the same steps in float32 with the same torch op on the same row, so their inputs,
  equal to ~1e-16, round to the same float32 values on whatever ISA both run (AVX2 or AVX-512
  kernels differ, but ours and transformers' run the same one in one process);
- float32 steps whose summation order depends on the batch shape or on the CPU: transformers'
  DeepSeek-V3 router computes its logits by a float32 GEMM (``F.linear`` of float32 casts) over
  one sequence, ours over the step's rows, and a float32 GEMM's blocking (so its rounding) changes
  with the row count on AVX2 (measured on a Zen 3: up to 2e-6 absolute on logits of a few units
  between 1..15 rows of the same product; 6.6e-8 of the largest |logit| in the end), and it sums
  top-k weights in ``topk(sorted=False)`` order; DeepSeek-V2 rotates q/k in complex64, ours in the
  model dtype. Such an island perturbs a value by the float32 rounding of a sum of at most
  hidden_size terms (the tiny test models: <= 128 terms: gamma_128 = 128 * 2**-24 = 2**-17
  relative), which reaches the logits through a bounded number of layers: 2**-17 of the largest
  |logit| (``FLOAT32_ISLAND_REL``; measured up to 2e-7);
- on a CUDA device every model's float32 steps run in CUDA's math library (its exp, rsqrt, sin and
  pow round differently from the host's by an ulp or two), so a GPU's float64 logits against the
  host's reference are bounded by the same 2**-17 (measured on an H200: 2.2e-7 to 3.3e-7 of the
  largest |logit|); DBO on against off, both on the GPU, stays exact.

Every test that compares our float64 logits with transformers' takes its bound from
``reference_rel`` and its model from ``reference_model``; ``tests/test_reference_bounds.py``
checks that no test builds a transformers model or fixes a float64 bound of its own.

float32 results are compared with the float64 reference at 2**-14 (~512 float32 ulps) of the
largest |logit|: summation-order rounding measured 3e-7 to 8e-7 relative on one rank here, ~3e-6
on two ranks on an AMD EPYC with avx512 (where a 1e-5 absolute bound failed); a real error (a wrong
weight, mask or route) is orders of magnitude larger. Bugs too small for that bound are the float64
tests' job.
"""

from __future__ import annotations

import torch

FLOAT64_REL = 1e-9
FLOAT32_ISLAND_REL = 2**-17  # a float32 step of transformers' whose rounding order is not ours
FLOAT32_REL = 2**-14
# model_type -> transformers' float32 step in a float64 model whose rounding can differ from ours
# by batch shape or CPU (the module docstring says why the others cannot)
FLOAT32_ISLANDS = {
    "deepseek_v2": "q/k rotated in complex64",
    "deepseek_v3": "router logits by a float32 GEMM over another row count; top-k weights summed "
    "in topk(sorted=False) order",
}


def reference_model(path, dtype: torch.dtype = torch.float64):
    """transformers' model of checkpoint ``path`` in ``dtype``, experts on the eager loop
    (``torch._grouped_mm``, transformers' default, takes no float64)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, experts_implementation="eager"
    ).eval()


def reference_rel(model_type: str, device_type: str = "cpu") -> float:
    """Relative bound (of the largest |logit|) of our float64 logits, computed on a
    ``device_type`` device, against transformers' float64 ones computed on the host: what
    transformers' float32 steps can contribute on any CPU (the module docstring derives it)."""
    if model_type in FLOAT32_ISLANDS or device_type != "cpu":
        return FLOAT32_ISLAND_REL
    return FLOAT64_REL


def assert_equals_transformers(
    actual, expected, *, model_type: str, device_type: str = "cpu", msg=None
) -> None:
    """Our float64 logits ``actual`` (computed on a ``device_type`` device) against transformers'
    float64 ``expected`` of the same checkpoint, within ``reference_rel(model_type,
    device_type)`` of the largest |expected|: the one bound of that comparison.

    Raises:
        AssertionError: from ``torch.testing.assert_close``, with ``msg`` if given.
    """
    assert torch.as_tensor(expected).dtype == torch.float64, "the reference is float64"
    assert_logits_close(actual, expected, rel=reference_rel(model_type, device_type), msg=msg)


def assert_same_sums(actual, expected, msg=None) -> None:
    """Two float64 results of our own code that differ only in summation order (another path,
    batch split or ubatching): within ``FLOAT64_REL`` of the largest |expected|."""
    assert_logits_close(actual, expected, rel=FLOAT64_REL, msg=msg)


def assert_logits_close(actual, expected, *, rel: float, msg=None) -> None:
    """|actual - expected| <= rel * max|expected| elementwise (``actual`` cast to expected's dtype).

    Raises:
        AssertionError: from ``torch.testing.assert_close``, with ``msg`` if given.
    """
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    atol = rel * float(expected.abs().max())
    torch.testing.assert_close(actual.to(expected.dtype), expected, rtol=0, atol=atol, msg=msg)
