"""Every module README.md and docs/*.md run with ``python -m X`` or ``torchrun ... -m X`` answers
``--help`` with status 0 (``launch.*`` with its usage line), and every entry point is documented.

The ``--help`` processes run in parallel, once per module, each with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.distributed import REPO
from tests.helpers.docs import DOC_FILES, modules_named, read

MODULES = sorted(set().union(*(modules_named(read(path)) for path in DOC_FILES)))
HELP_TIMEOUT_S = 120


def _entry_points() -> set[str]:
    """``launch`` modules a user runs: those with a ``__main__`` block."""
    return {
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in [
            *(REPO / "launch").glob("*.py"),
            *(REPO / "launch" / "benchmarks").glob("*.py"),
        ]
        if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")
    }


def _help(module: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def help_results() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(MODULES, pool.map(_help, MODULES), strict=True))


def test_the_docs_name_every_entry_point():
    entry_points = _entry_points()
    assert {"launch.generate", "launch.serve", "launch.bench", "launch.netns"} <= entry_points
    assert entry_points <= set(MODULES), f"not in README.md or docs/: {entry_points - set(MODULES)}"


@pytest.mark.parametrize("module", MODULES)
def test_help_exits_zero(module, help_results):
    proc = help_results[module]
    assert proc.returncode == 0, proc.stderr
    if module.startswith("launch."):
        assert proc.stdout.startswith(f"usage: {module}"), proc.stdout[:200]
