"""Fixtures of the moe tests."""

from __future__ import annotations

import pytest

from moe.kernels import tuning


@pytest.fixture
def tuning_file(tmp_path, monkeypatch):
    """A fresh tuning file (``moe.kernels.tuning``) for every kernel build, and an empty
    in-process record: the measurements of the test run and are kept there."""
    path = tmp_path / tuning.TUNING_FILE
    monkeypatch.setattr(tuning, "tuning_path", lambda _kernels: path)
    monkeypatch.setattr(tuning, "_max_rows", {})
    return path
