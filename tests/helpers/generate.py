"""Running ``launch.generate`` through torchrun as a user would, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command


def torchrun(nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m launch.generate args…`` from the repository root."""
    return subprocess.run(
        torchrun_command(nproc, "launch.generate", *args),
        cwd=REPO,
        env={**os.environ, **TORCHRUN_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_outputs(path: Path) -> list[dict]:
    """The JSON lines ``launch.generate --output`` wrote."""
    return [json.loads(line) for line in path.read_text().splitlines()]


# float32 and DBO thresholds low enough that the tiny test batches are microbatched
DBO_FLAGS = (
    "--dtype=float64",  # exact: greedy tokens equal transformers' float64 ones on any CPU
    "--enable-expert-parallel",
    "--enable-dbo",
    "--dbo-decode-token-threshold=2",
    "--dbo-prefill-token-threshold=4",
)
