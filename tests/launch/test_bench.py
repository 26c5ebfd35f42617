"""A short ``launch.bench`` run through torchrun writes well-formed JSON records and a PNG."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from launch.benchmarks.workload import BatchSpec, parse_batches
from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command

RECORD_KEYS = {
    "num_tokens_per_rank", "step_ms_off", "step_ms_on", "speedup", "compute_ms", "comm_ms",
    "exposed_comm_ms_off", "exposed_comm_ms_on", "overlap_ratio",
}  # fmt: skip


def test_parse_batches():
    assert parse_batches("decode:4, prefill:64,8") == [
        BatchSpec(kind="decode", num_tokens_per_rank=4),
        BatchSpec(kind="prefill", num_tokens_per_rank=64),
        BatchSpec(kind="decode", num_tokens_per_rank=8),
    ]
    with pytest.raises(ValueError, match="bad entry 'mixed:4'"):
        parse_batches("mixed:4")


@pytest.mark.slow
def test_short_bench_run_writes_json_and_png(tmp_path):
    out, timeline = tmp_path / "results.json", tmp_path / "tl"
    cmd = torchrun_command(
        2, "launch.bench", "--data-parallel-size", "2", "--enable-expert-parallel",
        "--batches", "decode:2,prefill:8", "--warmup", "0", "--reps", "2",
        "--hidden-size", "64", "--intermediate-size", "64", "--num-layers", "1",
        "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4",
        "--emulate-link", "latency_us=200,gbps=1", "--output", str(out),
        "--timeline-dir", str(timeline),
    )  # fmt: skip
    env = {**os.environ, **TORCHRUN_ENV}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["batch"] for r in records] == ["decode:2", "prefill:8"]
    for r in records:
        assert r.keys() >= RECORD_KEYS
        assert r["step_ms_off_min"] <= r["step_ms_off"] <= r["step_ms_off_max"]
        assert r["speedup"] > 0 and 0 <= r["overlap_ratio"] <= 1
        assert r["dbo_engaged"] and r["comm_ms"] > 0.2  # the link's latency is in M
        assert r["emulate_link"] == "latency_us=200,gbps=1" and r["reps"] == 2
    assert "speedup" in proc.stdout and "no overlaps on any track" in proc.stdout
    assert (timeline / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"rank0.json", "rank1.json", "timeline.json"} <= {p.name for p in timeline.iterdir()}
