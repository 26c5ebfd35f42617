"""``launch.benchmarks.collectives``: a 2-rank run prints every op at every size with a positive
time over gloo and over shared memory and the results checked; bad sizes are refused before any
rank starts."""

from __future__ import annotations

import datetime
import os
import re
import subprocess

import pytest

from launch.benchmarks import collectives as bench
from tests.helpers.cpu_kernels import needs_compiler
from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command


@pytest.mark.slow
@needs_compiler
def test_two_ranks_print_every_op_and_size():
    out = subprocess.run(
        torchrun_command(
            2,
            "launch.benchmarks.collectives",
            "--sizes",
            "64",
            "4100",
            "--calls",
            "3",
            "--rounds",
            "1",
        ),
        cwd=REPO,
        env={**os.environ, **TORCHRUN_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(
        r"^\| op \| bytes per rank \| gloo µs \| shm µs \| gloo / shm \|$", out.stdout, re.M
    )
    rows = re.findall(
        r"^\| (\w+) \| ([\d,]+) \| ([\d,.]+) \| ([\d,.]+) \| ([\d.]+)x \|$", out.stdout, re.M
    )
    assert {(name, size) for name, size, *_ in rows} == {
        (name, size)
        for name in ("all_reduce", "all_to_all_single", "all_gather_into", "reduce_scatter_sum")
        for size in ("64", "4,100")
    }
    assert all(float(t.replace(",", "")) > 0 for row in rows for t in row[2:])
    assert re.search(r"^TCP loopback round trip \(8 bytes\): [\d.]+ µs$", out.stdout, re.M)


@pytest.mark.parametrize("size", [0, -4, 6])
def test_a_size_not_a_positive_multiple_of_4_is_refused(size):
    with pytest.raises(ValueError, match="positive multiples of 4"):
        bench.ops(size, None, datetime.timedelta(seconds=1))  # before any group is used
    with pytest.raises(SystemExit):
        bench.main(["--sizes", str(size)])


def test_tcp_round_trip_is_timed():
    assert bench.tcp_round_trip_us(20) > 0
