"""Fixtures of the moe tests."""

from __future__ import annotations

import os

import pytest
import torch

from moe.kernels import tuning

# Triton's interpreter runs our Triton kernels on CPU tensors (tests/moe/test_triton_experts.py).
# Triton reads the variable when it is imported, so it is set before any test imports it, and
# only where no GPU could run the kernels compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tuning_file(tmp_path, monkeypatch):
    """A fresh tuning file (``moe.kernels.tuning``) for every kernel build, and an empty
    in-process record: the measurements of the test run and are kept there."""
    path = tmp_path / tuning.TUNING_FILE
    monkeypatch.setattr(tuning, "tuning_path", lambda _kernels: path)
    monkeypatch.setattr(tuning, "_max_rows", {})
    return path
