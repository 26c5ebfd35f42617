"""``launch.plan_sweep``: the grid of links, the rows, table and summary on fixed inputs, the
command line's errors, a bench run's processes ended with it (timeout, failure, SIGTERM, Ctrl-C),
and a tiny sweep end to end (calibration, two links, one repeat)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dbo.planning import planner
from dbo.planning.sweep import (
    SweepRow,
    format_sweep,
    grid_links,
    link_arg,
    link_label,
    parse_factors,
    summary,
    sweep_rows,
)
from distributed.link_emulation import LinkSpec
from launch import plan_sweep
from tests.helpers.distributed import REPO
from tests.launch.test_plan import sglang_decode_model


def test_grid_spans_the_factors_around_the_calibration_link():
    calibration = LinkSpec(latency_us=50, gbps=0.5)
    links = grid_links(calibration, (0.1, 1, 10), (0.1, 1, 10))
    assert len(links) == 9 and calibration in links
    assert [link_arg(s) for s in links[:3]] == [
        "latency_us=5,gbps=0.05",
        "latency_us=5,gbps=0.5",
        "latency_us=5,gbps=5",
    ]
    assert link_arg(links[-1]) == "latency_us=500,gbps=5"
    assert grid_links(calibration, (1, 1), (1,)) == [calibration]  # each link once
    assert link_label("latency_us=5,gbps=0.05") == "5 µs, 0.05 Gbit/s"
    assert link_label("loopback") == "loopback"
    assert parse_factors("0.1, 1,10", "--gbps-factors") == (0.1, 1.0, 10.0)
    for bad in ("", "a", "0,1", "nan", "1,inf"):
        with pytest.raises(ValueError, match="--gbps-factors"):
            parse_factors(bad, "--gbps-factors")


CAL = "latency_us=50,gbps=0.5"
FAST = "latency_us=5,gbps=5"
ROWS = [
    # 10 points exactly: within (1.10 - 1.00 is not 0.10 in floating point)
    SweepRow(link=CAL, batch="decode:32", runs=(1.0,), predicted=1.1, recommended=False),
    SweepRow(
        link=CAL,
        batch="decode:512",
        runs=(1.2, 1.5, 1.4),
        predicted=1.55,
        recommended=True,
    ),
    # recommended where DBO measured 0.90x (median): unsafe, and 30 points off
    SweepRow(link=FAST, batch="decode:32", runs=(0.93, 0.85, 0.9), predicted=1.2, recommended=True),
    SweepRow(
        link=FAST,
        batch="decode:64",
        runs=(0.96, 1.0),
        predicted=1.04,
        recommended=False,
        near_one=True,
    ),
]


def test_rows_table_and_summary_on_fixed_inputs():
    within, _, unsafe, near = ROWS
    assert within.is_within and within.difference_points == pytest.approx(10)
    assert ROWS[1].measured == 1.4 and ROWS[1].spread_points == pytest.approx(30)
    assert not ROWS[1].is_within and not ROWS[1].is_unsafe
    assert unsafe.is_unsafe and unsafe.measured == 0.9 and not unsafe.is_within
    assert near.measured == pytest.approx(0.98) and not near.is_unsafe
    assert format_sweep(ROWS, calibration=CAL).splitlines() == [
        "| link | batch | measured: median (runs' range) | predicted | difference (points) | "
        "spread (points) | planner | safe |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| 50 µs, 0.5 Gbit/s (calibration) | decode:32 | 1.00x (1.00..1.00) | 1.10x | +10 | 0 | "
        "off | yes |",
        "| 50 µs, 0.5 Gbit/s (calibration) | decode:512 | 1.40x (1.20..1.50) | 1.55x | +15 | 30 | "
        "DBO on | yes |",
        "| 5 µs, 5 Gbit/s | decode:32 | 0.90x (0.85..0.93) | 1.20x | +30 | 8 | DBO on | no |",
        "| 5 µs, 5 Gbit/s | decode:64 | 0.98x (0.96..1.00) | 1.04x | +6 | 4 | "
        "off (within the error of 1.0x) | yes |",
    ]
    assert summary(ROWS) == (
        "2 of 4 shapes within 10 points (50 %); 1 shapes where the planner recommends DBO and "
        "DBO measured below 0.95x"
    )
    assert summary([]).startswith("0 of 0 shapes within 10 points; 0 shapes")


def test_sweep_rows_take_the_recommended_thresholds():
    model, link = sglang_decode_model()
    tokens = (64, 96, 256)
    compared = [
        {
            "link": "deepep",
            "link_model": link,
            "batch": f"decode:{t}",
            "kind": "decode",
            "num_tokens": t,
            "runs": [1.0, 1.1],
            "measured": 1.05,
            "predicted": predict_n2(model, link, t),
        }
        for t in tokens
    ]
    rows = sweep_rows(model, compared, error=planner.DEFAULT_ERROR)
    threshold = planner.recommend(model, link, [2], {"decode": 256})["decode"]["threshold"]
    assert threshold == 128
    assert [(r.batch, r.recommended, r.near_one) for r in rows] == [
        ("decode:64", False, True),  # 0.97x
        ("decode:96", False, True),  # 1.09x: past the crossover, within the error
        ("decode:256", True, False),
    ]
    assert rows[0].runs == (1.0, 1.1) and rows[0].predicted == compared[0]["predicted"]
    # without an error bar DBO goes on from the crossover
    rows = sweep_rows(model, compared, error=0.0)
    assert [r.recommended for r in rows] == [False, True, True]


def predict_n2(model, link, tokens: int) -> float:
    return planner.predict(model, link, "decode", tokens, [2]).speedup[2]


def test_estimate_counts_the_steps_and_the_overhead():
    model, link = sglang_decode_model()
    shapes = [("decode", 64), ("prefill", 1024)]
    one, two = (plan_sweep.estimate_run_s(model, link, shapes, n, 0.0) for n in (1, 2))
    steps_s = sum(
        (p.step_ms_off + p.step_ms_on[2]) / 1e3
        for p in (planner.predict(model, link, k, t, [2]) for k, t in shapes)
    )
    assert two - one == pytest.approx(steps_s)
    assert plan_sweep.estimate_run_s(model, link, shapes, 1, 5.0) == pytest.approx(one + 5.0)


def test_bench_args_give_the_steps_per_arm():
    ns = plan_sweep.build_parser().parse_args([])
    steps = plan_sweep.check_bench_args(ns, ["--reps", "7", "--warmup", "1"], CAL, "decode:32")
    assert steps == 8
    assert plan_sweep.check_args(plan_sweep.build_parser().parse_args([]))["steps_per_arm"] == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
        (["--nproc", "1"], "argument --nproc: expected an integer >= 2, got '1'"),
        (["--latency-factors", "a"], "--latency-factors 'a': expected comma-separated numbers"),
        (["--gbps-factors", "0,1"], "--gbps-factors '0,1': expected finite factors > 0"),
        (["--latency-factors", "nan"], "--latency-factors 'nan': expected finite factors > 0"),
        (
            ["--calibration-link", "latency_us=inf,gbps=1"],
            "expected finite latency_us >= 0 (µs) and gbps > 0 (Gbit/s)",
        ),
        (
            ["--calibration-link", "latency_us=1e300,gbps=1", "--latency-factors", "1e10"]
            + ["--gbps-factors", "1"],
            "--latency-factors x --gbps-factors grid link 'latency_us=inf,gbps=1'",
        ),
        (["--calibration-link", "gbps=1"], "missing ['latency_us']"),
        (["--batches", "mixed:4"], "bad entry 'mixed:4'"),
        (["--calibration-batches", "prefill:-5"], "--calibration-batches 'prefill:-5': bad entry"),
        (["--bench-args", "--output x.json"], "['--output'] are set by the sweep"),
        (["--bench-args", "--reps abc"], "--bench-args: launch.bench: error: argument --reps"),
        (["--error-points", "-1"], "--error-points: expected a finite number in [0, 100)"),
        (["--max-run-s", "0"], "argument --max-run-s: expected a finite number > 0 (s), got '0'"),
        # nan ran the calibration without a timeout and planned 0 runs
        (["--max-run-s", "nan"], "argument --max-run-s: expected a finite number > 0 (s)"),
        (["--max-run-s", "inf"], "argument --max-run-s: expected a finite number > 0 (s)"),
        # flags passed on to launch.bench are checked by the bench's own checks, up front
        (["--bench-args", "--reps -1"], "need --warmup >= 0 and --reps >= 1, got 2, -1"),
        (["--bench-args", "--hidden-size 0"], "--bench-args: launch.bench refuses them"),
        (["--bench-args", "--num-threads 0"], "--num-threads must be >= 1, got 0"),
        (["--bench-args", "--distributed-timeout nan"], "--distributed-timeout"),
        (["--bench-args", "--emulate-link x"], "['--emulate-link'] are set by the sweep"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_sweep.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert err.startswith("launch.plan_sweep: error:")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by init, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_a_bench_run_that_fails_or_hangs_ends_with_its_log(tmp_path):
    log = tmp_path / "run.log"
    with pytest.raises(RuntimeError, match=r"failed \(log .*run.log\):\nbroken"):
        plan_sweep.run_bench([sys.executable, "-c", "print('broken'); exit(3)"], log, 30)
    # a hung run is stopped with the processes it started (torchrun's ranks)
    hang = "import subprocess, sys, time; "
    hang += "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    hang += "print(c.pid, flush=True); time.sleep(60)"
    with pytest.raises(RuntimeError, match="failed"):
        plan_sweep.run_bench([sys.executable, "-c", hang], log, 2)
    child = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


# torchrun's shape: a parent whose "rank" runs in a session of its own (and, here, ignores
# SIGTERM, so only the SIGKILL after the grace period ends it); both pids printed
TORCHRUN_LIKE = (
    "import signal, subprocess, sys, time\n"
    "rank = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'\n"
    "c = subprocess.Popen([sys.executable, '-c', rank], start_new_session=True)\n"
    "print(c.pid, flush=True); time.sleep(120)\n"
)
# the driver restores Python's SIGINT handler: a suite started as a shell's background job
# inherits SIGINT ignored, and Python installs its handler only where SIGINT is not ignored
SWEEP_DRIVER = (
    "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "import sys\nfrom pathlib import Path\nfrom launch import plan_sweep\n"
    "plan_sweep.STOP_GRACE_S = 1.0\n"
    "plan_sweep.run_bench([sys.executable, '-c', sys.argv[2]], Path(sys.argv[1]), 600)\n"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_sweep_ends_its_bench_run_and_the_ranks(tmp_path, sig):
    log = tmp_path / "run.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen(
        [sys.executable, "-c", SWEEP_DRIVER, str(log), TORCHRUN_LIKE], env=env, cwd=REPO
    )
    rank = None
    try:
        deadline = time.monotonic() + 60
        while rank is None and time.monotonic() < deadline:
            text = log.read_text() if log.exists() else ""
            rank = int(text.split()[0]) if text.strip() else None
            time.sleep(0.1)
        assert rank is not None and _alive(rank), "the bench run did not start"
        driver.send_signal(sig)
        driver.wait(timeout=30)  # bounded: the grace period is 1 s
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank), f"the rank (pid {rank}) outlived the sweep"
    finally:
        driver.kill()
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.slow
def test_tiny_sweep_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [
        *("--calibration-link", "latency_us=200,gbps=0.5"),
        *("--latency-factors", "1", "--gbps-factors", "1,10", "--repeats", "1"),
        *("--calibration-batches", "decode:4,decode:16,prefill:64"),
        *("--batches", "decode:8,prefill:32", "--output-dir", str(tmp_path)),
        "--bench-args",
        "--hidden-size 64 --intermediate-size 64 --num-layers 1 --reps 2 --warmup 0",
    ]
    assert plan_sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "launch.plan_sweep: 2 links x 1 repeats = 2 bench runs" in out
    table = (tmp_path / "sweep.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 200 µs")]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 200 µs, 0.5 Gbit/s (calibration)", "decode:8"],
        ["| 200 µs, 0.5 Gbit/s (calibration)", "prefill:32"],
        ["| 200 µs, 5 Gbit/s", "decode:8"],
        ["| 200 µs, 5 Gbit/s", "prefill:32"],
    ]
    assert re.search(
        r"^\d of 4 shapes within 10 points \(\d+ %\); \d shapes where the planner recommends DBO "
        r"and DBO measured below 0.95x$",
        table,
        re.MULTILINE,
    )
    assert table in out + "\n"
    assert (tmp_path / "calibration" / "rank0.json").is_file()
    assert (tmp_path / "latency_us200_gbps5" / "run0.json").is_file()
