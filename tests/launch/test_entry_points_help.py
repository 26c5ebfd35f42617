"""Every ``-m launch.*`` module the README names answers ``--help`` with its usage and status 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.distributed import REPO

MODULES = sorted(set(re.findall(r"-m (launch\.[a-z_.]*[a-z_])", (REPO / "README.md").read_text())))


def test_the_readme_names_every_entry_point():
    assert {"launch.generate", "launch.serve", "launch.bench", "launch.netns"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_help_exits_zero(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {module}"), proc.stdout[:200]
