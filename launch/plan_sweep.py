"""Check the planner on links it was not calibrated on: ``python -m launch.plan_sweep``.

Runs ``launch.bench`` through torchrun once on ``--calibration-link``, fits the planner to it,
then on every link of a grid around it, and prints per link and shape the measured and predicted
speedups and whether the recommended thresholds were safe (``dbo.planning.sweep``). Flags, output
directory, a measured run: docs/planner.md#on-links-it-was-not-calibrated-on."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from launch.engine.arg_utils import OneLineErrorParser, bounded_number, parse_link
from launch.process_tree import DEFAULT_GRACE_S, ProcessTree

PROG = "launch.plan_sweep"
CALIBRATION_BATCHES = "decode:32,decode:128,decode:512,prefill:768,prefill:2048"
BATCHES = "decode:32,decode:64,decode:128,decode:256,decode:512,prefill:256,prefill:1024"
BENCH_ARGS = (
    "--dtype float32 --num-layers 12 --num-gpu-blocks-override 4096 "
    "--max-num-batched-tokens 4096 --reps 7 --warmup 1"
)
STOP_GRACE_S = DEFAULT_GRACE_S  # a stopped bench run's SIGTERM -> SIGKILL
# launch.bench flags the sweep sets itself
RESERVED = (
    "--batches",
    "--arms",
    "--emulate-link",
    "--output",
    "--timeline-dir",
    "--data-parallel-size",
    "--enable-expert-parallel",
    "--dbo-decode-token-threshold",
    "--dbo-prefill-token-threshold",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    add = parser.add_argument
    add(
        "--calibration-link",
        default="latency_us=50,gbps=0.5",
        help="the link to calibrate on, in --emulate-link's units (default: link B of "
        "docs/planner.md)",
    )
    add("--latency-factors", default="0.1,1,10", help="grid: the calibration latency times each")
    add("--gbps-factors", default="0.1,1,10", help="grid: the calibration bandwidth times each")
    add("--calibration-batches", default=CALIBRATION_BATCHES, help="launch.bench --batches to fit")
    add("--batches", default=BATCHES, help="launch.bench --batches compared on every grid link")
    # every numeric flag is finite and in range at parse time; the links and --bench-args (passed
    # on to launch.bench) are checked by check_args, before anything starts
    add(
        "--repeats",
        type=bounded_number(int, low=1),
        default=3,
        help="bench runs per grid link (the spread)",
    )
    add(
        "--nproc",
        type=bounded_number(int, low=2),
        default=2,
        help="DP ranks (expert parallel across them)",
    )
    add("--bench-args", default=BENCH_ARGS, help="further launch.bench flags (model, reps, ...)")
    add(
        "--error-points",
        type=bounded_number(low=0, high=100, unit="points"),
        default=None,
        help="the planner's error bar in points (default: planner.DEFAULT_ERROR, 10)",
    )
    add(
        "--max-run-s",
        type=bounded_number(low=0, low_inclusive=False, unit="s"),
        default=600.0,
        help="skip grid links whose bench run is estimated longer (s); a run is stopped after "
        "3x this",
    )
    add("--output-dir", default=None, help="where runs land (default: a new temporary directory)")
    add("--dry-run", action="store_true", help="calibrate, print the estimates, run no grid")
    return parser


def check_bench_args(ns, bench_args: list[str], link: str, batches: str) -> int:
    """Check a bench run's flags as ``launch.bench`` itself does (its parser and its checks,
    ``bench.check_run``: ranges, the engine flags, the model), before anything starts; the
    warm-up + measured steps per arm and shape.

    Raises:
        ValueError: flags ``launch.bench`` refuses (its message, prefixed ``--bench-args:``), or
            one the sweep sets itself.
    """
    from launch import bench

    reserved = [a for a in bench_args if a.split("=")[0] in RESERVED]
    if reserved:
        raise ValueError(f"--bench-args: {reserved} are set by the sweep")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = bench.build_parser().parse_args(
                bench_flags(ns, bench_args, link, batches, output=None)
            )
        bench.check_run(parsed, world_size=ns.nproc)
    except SystemExit:
        raise ValueError(f"--bench-args: {err.getvalue().strip()}") from None
    except (ValueError, OSError) as e:
        raise ValueError(f"--bench-args: launch.bench refuses them: {e}") from None
    return parsed.warmup + parsed.reps


def check_args(ns) -> dict:
    """The parsed sweep: ``calibration`` (``LinkSpec``), ``links`` (the grid), ``shapes`` and
    ``calibration_shapes`` (``(kind, tokens)``), ``bench_args``, ``steps_per_arm``, ``error``.

    Raises:
        ValueError: naming the bad value.
    """
    from dbo.planning import planner, sweep
    from launch.benchmarks.workload import parse_batches

    try:
        calibration = parse_link(ns.calibration_link, "link")
    except ValueError as e:
        raise ValueError(f"--calibration-link: {e}") from None
    links = sweep.grid_links(
        calibration,
        sweep.parse_factors(ns.latency_factors, "--latency-factors"),
        sweep.parse_factors(ns.gbps_factors, "--gbps-factors"),
    )
    for spec in links:  # a product of finite values may still overflow
        parse_link(sweep.link_arg(spec), "--latency-factors x --gbps-factors grid link")
    shapes = [(s.kind, s.num_tokens_per_rank) for s in parse_batches(ns.batches)]
    calibration_shapes = [
        (s.kind, s.num_tokens_per_rank)
        for s in parse_batches(ns.calibration_batches, "--calibration-batches")
    ]
    bench_args = shlex.split(ns.bench_args)
    link = sweep.link_arg(calibration)
    check_bench_args(ns, bench_args, link, ns.batches)
    return {
        "calibration": calibration,
        "links": links,
        "shapes": shapes,
        "calibration_shapes": calibration_shapes,
        "bench_args": bench_args,
        "steps_per_arm": check_bench_args(ns, bench_args, link, ns.calibration_batches),
        "error": planner.DEFAULT_ERROR if ns.error_points is None else ns.error_points / 100,
    }


def bench_command(ns, bench_args: list[str], link: str, batches: str, output: Path) -> list[str]:
    """``torchrun … -m launch.bench`` of ``batches`` on the emulated ``link``, DBO off and on."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc-per-node={ns.nproc}", "-m", "launch.bench"),
        *bench_flags(ns, bench_args, link, batches, output),
    ]


def bench_flags(
    ns, bench_args: list[str], link: str, batches: str, output: Path | None
) -> list[str]:
    """``launch.bench``'s flags of one sweep run (``--output`` only where given)."""
    return [
        *(f"--data-parallel-size={ns.nproc}", "--enable-expert-parallel", "--arms", "off,on"),
        # thresholds of 2: the DBO arm microbatches every shape
        *("--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "2"),
        *("--batches", batches, "--emulate-link", link),
        *(("--output", str(output)) if output is not None else ()),
        *bench_args,
    ]


def run_bench(cmd: list[str], log_path: Path, timeout_s: float) -> float:
    """Run one bench command, its output in ``log_path``; its wall time in s.

    Raises:
        RuntimeError: it failed or ran past ``timeout_s`` (the log's tail in the message).
    """
    root = str(Path(__file__).resolve().parents[1])  # the ranks import this checkout's launch
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
    }
    start = time.monotonic()
    with open(log_path, "wb") as log:
        # its own session; torchrun's ranks (in sessions of their own) end with it on a timeout,
        # an error, Ctrl-C, SIGTERM or this process's exit
        cmd_env = {"stdout": log, "stderr": subprocess.STDOUT, "env": env}
        with ProcessTree(cmd, grace_s=STOP_GRACE_S, **cmd_env) as tree:
            failed = tree.wait(timeout_s) != 0  # None (still running) counts as failed
    if failed:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{shlex.join(cmd)} failed (log {log_path}):\n{tail}")
    return time.monotonic() - start


def estimate_run_s(
    model, link, shapes: Sequence[tuple[str, int]], steps_per_arm: int, overhead_s: float
) -> float:
    """Seconds a ``launch.bench --arms off,on`` run of ``shapes`` (kind, tokens per rank) on
    ``link`` (a ``LinkModel``) is predicted to take: ``steps_per_arm`` (warm-up + measured)
    predicted steps per arm and shape, a decode shape's prompt prefill (its requests' prompts in
    one DBO-off step), plus ``overhead_s`` per run (start-up, building the engine)."""
    from dbo.planning import planner
    from launch.benchmarks.workload import DECODE_PROMPT_LEN

    steps_ms = 0.0
    for kind, tokens in shapes:
        p = planner.predict(model, link, kind, tokens, [2])
        steps_ms += steps_per_arm * (p.step_ms_off + p.step_ms_on.get(2, p.step_ms_off))
        if kind == "decode":
            steps_ms += planner.step_ms(model, link, "prefill", tokens * DECODE_PROMPT_LEN, 1)
    return overhead_s + steps_ms / 1e3


def calibrate(ns, sweep_args: dict, out: Path):
    """The calibration run on the calibration link and the planner fitted to it; (model, the
    per-run overhead in s: its wall time beyond its predicted steps)."""
    from dbo.planning import sweep
    from dbo.planning.calibrated_model import calibrate as fit
    from dbo.planning.links import from_gbps

    cal_dir = out / "calibration"
    cmd = bench_command(
        ns,
        [*sweep_args["bench_args"], "--timeline-dir", str(cal_dir)],
        sweep.link_arg(sweep_args["calibration"]),
        ns.calibration_batches,
        cal_dir / "results.json",
    )
    print(f"{PROG}: calibrating: {shlex.join(cmd)}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    wall_s = run_bench(cmd, out / "calibration.log", 3 * ns.max_run_s)
    model = fit(cal_dir)
    spec = sweep_args["calibration"]
    link = model.adapt_link(from_gbps(spec.latency_us, spec.gbps))
    steps_s = estimate_run_s(
        model, link, sweep_args["calibration_shapes"], sweep_args["steps_per_arm"], 0.0
    )
    return model, max(wall_s - steps_s, 0.0)


def plan_links(model, sweep_args: dict, overhead_s: float, max_run_s: float):
    """(the grid links to run with their estimated s per run, the skipped ones likewise)."""
    from dbo.planning.links import from_gbps

    kept, skipped = [], []
    for spec in sweep_args["links"]:
        link = model.adapt_link(from_gbps(spec.latency_us, spec.gbps))
        estimate = estimate_run_s(
            model, link, sweep_args["shapes"], sweep_args["steps_per_arm"], overhead_s
        )
        (kept if estimate <= max_run_s else skipped).append((spec, estimate))
    return kept, skipped


def run_grid(ns, sweep_args: dict, kept, out: Path) -> list[str]:
    """Each kept link once per repeat, ``--repeats`` times; the results files written."""
    from dbo.planning import sweep

    paths = []
    for r in range(ns.repeats):
        for spec, estimate in kept:
            link = sweep.link_arg(spec)
            link_dir = out / link.replace(",", "_").replace("=", "")
            link_dir.mkdir(parents=True, exist_ok=True)
            path = link_dir / f"run{r}.json"
            cmd = bench_command(ns, sweep_args["bench_args"], link, ns.batches, path)
            print(f"{PROG}: run {r + 1}/{ns.repeats} on {link} (~{estimate:.0f} s)", flush=True)
            run_bench(cmd, link_dir / f"run{r}.log", 3 * ns.max_run_s)
            paths.append(str(path))
    return paths


def report(model, sweep_args: dict, paths: list[str], skipped, out: Path) -> str:
    """The table and the summary (printed and written to ``out/sweep.md``)."""
    from dbo.planning import report as plan_report
    from dbo.planning import sweep

    rows = sweep.sweep_rows(
        model, plan_report.compare(model, model.link, paths), sweep_args["error"]
    )
    calibration = sweep.link_arg(sweep_args["calibration"])
    text = sweep.format_sweep(rows, calibration) + "\n\n" + sweep.summary(rows)
    if skipped:
        names = ", ".join(f"{sweep.link_arg(s)} (~{e:.0f} s a run)" for s, e in skipped)
        text += f"\nskipped (estimated over --max-run-s): {names}"
    (out / "sweep.md").write_text(text + "\n", encoding="utf-8")
    return text


def print_plan(kept, skipped, repeats: int, overhead_s: float) -> None:
    """Each grid link with its estimated s per run, and the total."""
    from dbo.planning.sweep import link_arg

    for spec, estimate in kept:
        print(f"{PROG}: {link_arg(spec)}: ~{estimate:.0f} s a run, x {repeats}")
    for spec, estimate in skipped:
        print(f"{PROG}: {link_arg(spec)}: ~{estimate:.0f} s a run, skipped (over --max-run-s)")
    total_s = repeats * sum(e for _, e in kept)
    print(
        f"{PROG}: {len(kept)} links x {repeats} repeats = {len(kept) * repeats} bench runs, "
        f"~{total_s / 60:.1f} min (a run's overhead beyond its steps: {overhead_s:.0f} s)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        sweep_args = check_args(ns)
    except ValueError as e:
        parser.error(str(e))
    out = Path(ns.output_dir or tempfile.mkdtemp(prefix="plan-sweep-"))
    try:
        model, overhead_s = calibrate(ns, sweep_args, out)
        kept, skipped = plan_links(model, sweep_args, overhead_s, ns.max_run_s)
        print_plan(kept, skipped, ns.repeats, overhead_s)
        if ns.dry_run:
            return 0
        paths = run_grid(ns, sweep_args, kept, out)
        print(report(model, sweep_args, paths, skipped, out))
        print(f"{PROG}: wrote {out / 'sweep.md'}")
    except (ValueError, OSError, RuntimeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
