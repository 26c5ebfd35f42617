"""Whether Triton can launch kernels in this process (``triton_unavailable_reason``): asked by
the CUDA platform for its attention backends and by the Triton ops before each launch."""

from __future__ import annotations

import functools
import importlib.util

import torch


def triton_unavailable_reason() -> str | None:
    """Why Triton cannot launch kernels in this process, or None: it must be importable, and
    there must be a CUDA device or Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors).
    Imports Triton on the first call."""
    return _triton_unavailable_reason()


@functools.cache
def _triton_unavailable_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    import triton

    if torch.cuda.is_available() or triton.knobs.runtime.interpret:
        return None
    return "no CUDA device (and Triton's interpreter is off)"
