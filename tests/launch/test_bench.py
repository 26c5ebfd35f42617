"""A short ``launch.bench`` run through torchrun writes well-formed JSON records and a PNG."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from launch.bench import (
    MAX_EXPLORATION_STEPS,
    balanced_order,
    build_parser,
    expand_arms,
    num_workload_steps,
    parse_arms,
    split_arm,
    steps_of_count,
)
from launch.benchmarks.bench_records import make_record
from launch.benchmarks.workload import BatchSpec, parse_batches
from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command

RECORD_KEYS = {
    "num_tokens_per_rank",
    "step_ms_off",
    "step_ms_on",
    "speedup",
    "compute_ms",
    "comm_ms",
    "exposed_comm_ms_off",
    "exposed_comm_ms_on",
    "overlap_ratio",
}


def test_parse_batches():
    assert parse_batches("decode:4, prefill:64,8") == [
        BatchSpec(kind="decode", num_tokens_per_rank=4),
        BatchSpec(kind="prefill", num_tokens_per_rank=64),
        BatchSpec(kind="decode", num_tokens_per_rank=8),
    ]
    with pytest.raises(ValueError, match="bad entry 'mixed:4'"):
        parse_batches("mixed:4")


def test_arms_and_their_balanced_order():
    assert parse_arms("off,on,adaptive") == ("off", "on", "adaptive")
    for bad in ("off,adaptive", "off,on,on", "off,on,dbo"):
        with pytest.raises(ValueError, match="need off and on, optionally adaptive, each once"):
            parse_arms(bad)
    arms = ("off", "on", "adaptive")
    rounds = [balanced_order(arms, i) for i in range(6)]
    # every arm runs once per round, and over 6 rounds each arm follows each other arm as often
    assert all(sorted(r) == sorted(arms) for r in rounds)
    follows = [(r[k - 1], r[k]) for r in rounds for k in (1, 2)]
    assert len(set(follows)) == 6 and all(follows.count(p) == 2 for p in set(follows))


def test_a_list_of_ubatch_counts_splits_the_on_arm():
    assert build_parser().parse_args([]).ubatch_sizes == [2]
    assert build_parser().parse_args(["--ubatch-size", "2", "3", "4"]).ubatch_sizes == [2, 3, 4]
    assert build_parser().parse_args(["--num-ubatches", "3"]).ubatch_sizes == [3]
    arms = expand_arms(("off", "on", "adaptive"), (2, 4))
    assert arms == ("off", "on:2", "on:4", "adaptive")
    assert [split_arm(a) for a in arms] == [("off", None), ("on", 2), ("on", 4), ("adaptive", None)]
    steps = [
        {"arm": "off", "ubatch_size": 2},
        {"arm": "on", "ubatch_size": 2},
        {"arm": "on", "ubatch_size": 4},
        {"arm": "adaptive", "ubatch_size": 2},
    ]
    # each count's record: the shared off steps, its own on steps, adaptive with the first count
    assert steps_of_count(steps, 2, first=2) == [steps[0], steps[1], steps[3]]
    assert steps_of_count(steps, 4, first=2) == [steps[0], steps[2]]


def test_workload_steps_leave_nothing_to_drain_without_the_adaptive_arm():
    ns = build_parser().parse_args(["--warmup", "1", "--reps", "7"])
    assert num_workload_steps(("off", "on:2"), ns) == 16
    # the adaptive arm's exploration runs before the measured steps: its steps on top
    assert num_workload_steps(("off", "on:2", "adaptive"), ns) == 24 + MAX_EXPLORATION_STEPS


def _step(arm, step_ms, *, is_ubatched=False, exploring=False):
    zeros = dict.fromkeys(("exposed_comm_ms", "overlap_ratio", "baton_pass_us_median"), 0.0)
    return {
        **zeros,
        "compute_ms": 1.0,
        "comm_ms": 1.0,
        "arm": arm,
        "dbo": arm != "off",
        "exploring": exploring,
        "step_ms": step_ms,
        "is_ubatched": is_ubatched,
        "num_baton_passes": 0,
        "num_spans": 1,
    }


def test_record_of_the_adaptive_arm_against_the_better_static_one():
    per_rank = [
        [
            _step("adaptive", 50.0, exploring=True),
            _step("adaptive", 40.0, is_ubatched=True, exploring=True),
            {**_step("off", 10.0 + r), "round": 0},
            {**_step("on", 8.0 + r, is_ubatched=True), "round": 0},
            {**_step("adaptive", 8.4 + r, is_ubatched=True), "round": 0},
            {**_step("adaptive", 18.0 + r, is_ubatched=True), "round": 1},  # a slow round:
            {**_step("on", 16.0 + r, is_ubatched=True), "round": 1},  # every arm is slower
            {**_step("off", 20.0 + r), "round": 1},
        ]
        for r in range(2)
    ]
    record = make_record(
        BatchSpec(kind="decode", num_tokens_per_rank=64), per_rank, span_cost_ns=0.0, meta={}
    )
    # the slowest rank (rank 1) is the step: off 11 / 21, on 9 / 17, adaptive 9.4 / 19
    assert (record["step_ms_off"], record["step_ms_on"]) == (16.0, 13.0)
    assert record["step_ms_adaptive"] == pytest.approx((9.4 + 19) / 2)
    assert record["adaptive_choice"] == "on" and record["adaptive_reps"] == 2
    assert record["best_static_arm"] == "on"
    assert record["adaptive_vs_best"] == pytest.approx(14.2 / 13.0)
    assert record["adaptive_vs_best_paired"] == pytest.approx((9.4 / 9 + 19 / 17) / 2)
    assert record["adaptive_exploration_steps"] == 2
    assert record["step_ms_adaptive_exploring"] == pytest.approx(45.0)
    assert record["reps"] == 2 and record["speedup"] == pytest.approx(16 / 13)
    # every step in the order it ran, the slowest rank's time
    assert [(s["arm"], s["round"], s["step_ms"]) for s in record["steps"]] == [
        ("adaptive", None, 50.0),
        ("adaptive", None, 40.0),
        ("off", 0, 11.0),
        ("on", 0, 9.0),
        ("adaptive", 0, 9.4),
        ("adaptive", 1, 19.0),
        ("on", 1, 17.0),
        ("off", 1, 21.0),
    ]
    assert [s["exploring"] for s in record["steps"]] == [True, True] + [False] * 6


@pytest.mark.slow
def test_short_bench_run_writes_json_and_png(tmp_path):
    out, timeline = tmp_path / "results.json", tmp_path / "tl"
    cmd = torchrun_command(
        2,
        "launch.bench",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--batches",
        "decode:2,prefill:8",
        "--warmup",
        "0",
        "--reps",
        "2",
        "--hidden-size",
        "64",
        "--intermediate-size",
        "64",
        "--num-layers",
        "1",
        "--dbo-decode-token-threshold",
        "2",
        "--dbo-prefill-token-threshold",
        "4",
        "--emulate-link",
        "latency_us=200,gbps=1",
        "--output",
        str(out),
        "--timeline-dir",
        str(timeline),
        "--ubatch-size",
        "2",
        "3",
    )
    env = {**os.environ, **TORCHRUN_ENV}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    # one record per shape and ubatch count; decode:2 cannot fill 3 ubatches: it ran 2
    assert [(r["batch"], r["ubatch_size"], r["ubatches_run"]) for r in records] == [
        ("decode:2", 2, [2]),
        ("decode:2", 3, [2]),
        ("prefill:8", 2, [2]),
        ("prefill:8", 3, [3]),
    ]
    for r in records:
        assert r.keys() >= RECORD_KEYS
        assert r["step_ms_off_min"] <= r["step_ms_off"] <= r["step_ms_off_max"]
        assert r["speedup"] > 0 and 0 <= r["overlap_ratio"] <= 1
        assert r["dbo_engaged"] and r["comm_ms"] > 0.2  # the link's latency is in M
        assert r["emulate_link"] == "latency_us=200,gbps=1" and r["reps"] == 2
        if r["ubatch_size"] == 3:
            assert "step_ms_adaptive" not in r  # the adaptive arm ran with the first count
            continue
        # the adaptive arm: explored both arms (4 steps each by default), then measured reps
        assert r["adaptive_exploration_steps"] >= 8 and r["adaptive_reps"] == 2
        assert r["adaptive_choice"] in ("on", "off", "mixed") and r["adaptive_vs_best"] > 0
    assert (
        "ad/best" in proc.stdout
        and "speedup" in proc.stdout
        and "no overlaps on any track" in proc.stdout
    )
    assert (timeline / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"rank0.json", "rank1.json", "timeline.json"} <= {p.name for p in timeline.iterdir()}
    # behind the emulated link each transfer says when its peers' bytes were there (the
    # planner's calibration reads it): never after the link let the transfer complete
    events = json.loads((timeline / "rank0.json").read_text())["traceEvents"]
    transfers = [e for e in events if e.get("cat") == "comm" and e["name"].endswith("dispatch")]
    assert transfers and all(
        0 <= e["args"]["payload_ms"] <= e["dur"] / 1e3 + 1e-6 for e in transfers
    )
