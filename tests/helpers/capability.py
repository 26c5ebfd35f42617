"""Skips that follow the capability probes the engine itself uses (``moe.platforms``): a test
that a particular pack or kernel runs skips, with the probe's reason, where this CPU cannot have
it; tests about the maths compare with ``forward_native`` whichever path runs."""

from __future__ import annotations

import pytest
import torch

from moe.layers.linear import packing_unavailable_reason


def needs_onednn(dtype: torch.dtype) -> pytest.MarkDecorator:
    """Skip unless oneDNN prepacks ``dtype`` weights on this CPU (the probe's reason shown)."""
    reason = packing_unavailable_reason(dtype)
    return pytest.mark.skipif(reason is not None, reason=f"no oneDNN {dtype} pack: {reason}")


def onednn_dtypes(*dtypes: torch.dtype) -> list:
    """``dtypes`` as pytest params, each skipped where oneDNN cannot pack it here."""
    return [
        pytest.param(d, marks=needs_onednn(d), id=str(d).removeprefix("torch.")) for d in dtypes
    ]
