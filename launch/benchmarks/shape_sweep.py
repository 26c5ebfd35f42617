"""Shape sweep: our throughput against vLLM's CPU engine on a grid of Mixtral-, Qwen2-MoE- and
DeepSeek-V3-shaped random checkpoints (``launch.benchmarks.shape_grid`` holds the grid).

Per shape and dtype, one command at a time: ours and vLLM on core 0, eager (``peer_table``'s
commands); prints a markdown row each and the worst ratio, and writes ``OUT_DIR/sweep.json``.
Usage, output and results: docs/benchmarks.md#shape-sweep-launchbenchmarksshape_sweep."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from launch.benchmarks.peer_table import (
    add_cpu_isa_argument,
    format_rate,
    format_ratio,
    run_ours,
    run_vllm,
    same_tokens,
)
from launch.benchmarks.shape_grid import GRIDS, Shape, ensure_checkpoint, param_counts

DTYPES = ("float32", "bfloat16")
HEADER = (
    "| shape | dtype | ours tok/s | vLLM tok/s | ours/vLLM | same tokens |\n"
    "| --- | --- | --- | --- | --- | --- |"
)
ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")


def vllm_absence(vllm_python: str | None) -> str | None:
    """Why the vLLM column is absent (no interpreter given, or it cannot import vLLM), or None
    when ``vllm_python`` imports it (a check of up to 5 minutes: the first import is slow)."""
    if not vllm_python:
        return "no --vllm-python given"
    try:
        proc = subprocess.run([vllm_python, "-c", "import vllm"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{vllm_python} did not run: {e}"
    return f"{vllm_python} cannot import vllm" if proc.returncode else None


def error_summary(result: dict) -> str:
    """The root error of a failed run, for a table cell: the last ``<Name>Error: message`` (or
    ``Exception``) of its output (its log if written, else its output's tail), leaving out
    warnings and errors that only point "above"; else the output's last line. At most 100
    characters, "|"-free."""
    text = Path(result["log"]).read_text() if "log" in result else result.get("error", "")
    errors = [
        f"{m.group(1)}: {m.group(2)}"
        for line in text.splitlines()
        if " WARNING " not in line and (m := ERROR_LINE.search(line))
        if "above" not in m.group(2)
    ]
    last = errors[-1] if errors else (text.strip().splitlines() or ["no output"])[-1].strip()
    return last.replace("|", "/")[:100]


def ratio(row: dict) -> float | None:
    """ours / vLLM tokens/s of a row; None unless both ran."""
    ours, vllm = row["ours"].get("tokens_per_s"), row["vllm"].get("tokens_per_s")
    return ours / vllm if ours and vllm else None


def _vllm_cell(result: dict) -> str:
    if "absent" in result:
        return "absent"
    return format_rate(result) if "tokens_per_s" in result else f"failed: {error_summary(result)}"


def format_row(row: dict) -> str:
    """A row of ``HEADER``'s table."""
    ours, vllm = row["ours"], row["vllm"]
    rates = ours.get("tokens_per_s", 0), vllm.get("tokens_per_s", 0)
    return (
        f"| {row['shape']} | {row['dtype']} | {format_rate(ours)} | {_vllm_cell(vllm)} "
        f"| {format_ratio(*rates)} | {same_tokens(ours, vllm)} |"
    )


def worst_line(rows: list[dict]) -> str:
    """``worst: <shape> <dtype> <ratio>x`` of the lowest ours / vLLM ratio among the rows where
    both engines ran; says so when none did."""
    rated = [(r, ratio(r)) for r in rows if ratio(r) is not None]
    if not rated:
        return "worst: - (no shape has both engines' rates)"
    row, value = min(rated, key=lambda pair: pair[1])
    return f"worst: {row['shape']} {row['dtype']} {value:.2f}x"


def sweep_row(ns, shape: Shape, dtype: str, model_dir: Path, prompts: Path) -> dict:
    """Ours, then vLLM (unless ``ns.vllm_absent``), on one shape and dtype; each result has
    ``tokens_per_s`` and ``tokens``, or ``error`` (and ``log``), or ``absent``."""
    tag = f"{shape.name}_{dtype}"
    model, prompts_path = str(model_dir), str(prompts)
    ours = run_ours(ns, model, prompts_path, dtype, ranks=1, eager=True, tag=f"{tag}_ours")
    if ns.vllm_absent:
        vllm = {"absent": ns.vllm_absent}
    else:
        vllm = run_vllm(
            ns, model, prompts_path, dtype, threads="0", compile_=False, tag=f"{tag}_vllm"
        )
    return {"shape": shape.name, "family": shape.family, "dtype": dtype, "ours": ours, "vllm": vllm}


def run_sweep(ns, shapes: tuple[Shape, ...]) -> list[dict]:
    """Every shape and dtype of ``ns.dtypes``, one row printed as each finishes."""
    print(HEADER, flush=True)
    rows = []
    for shape in shapes:
        model_dir, prompts = ensure_checkpoint(shape, ns.out_dir / "checkpoints", ns.num_prompts)
        for dtype in ns.dtypes:
            row = sweep_row(ns, shape, dtype, model_dir, prompts)
            row["same_tokens"] = same_tokens(row["ours"], row["vllm"])
            print(format_row(row), flush=True)
            rows.append(row)
    return rows


def print_grid(shapes: tuple[Shape, ...]) -> None:
    """The grid as a markdown table, with each shape's parameter counts (millions)."""
    print("| shape | experts | top-k | hidden | expert inter | layers | heads / kv | vocab "
          "| prompts | params M | active M |")  # fmt: skip
    print("| --- " * 11 + "|")
    for s in shapes:
        total, active = param_counts(s)
        kv_heads = "MLA" if s.family == "deepseekv3" else s.num_kv_heads
        print(
            f"| {s.name} | {s.num_experts} | {s.top_k} | {s.hidden_size} "
            f"| {s.moe_intermediate_size} | {s.num_layers} | {s.num_heads} / {kv_heads} "
            f"| {s.vocab_size} | {s.prompt_len[0]}-{s.prompt_len[1]} | {total / 1e6:.1f} "
            f"| {active / 1e6:.1f} |"
        )


def _selected(parser, grid: str, only: str | None) -> tuple[Shape, ...]:
    shapes = GRIDS[grid]
    if not only:
        return shapes
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {s.name for s in shapes})
    if unknown:
        parser.error(
            f"--only: {', '.join(unknown)} not in the {grid} grid: "
            f"{', '.join(s.name for s in shapes)}"
        )
    return tuple(s for s in shapes if s.name in names)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.benchmarks.shape_sweep", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv (omit: ours only)")
    p.add_argument("--vllm-runner", default=None, help="run_vllm.py (needed with --vllm-python)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="default")
    p.add_argument("--dtype", default=",".join(DTYPES), help="comma-separated: float32,bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--only", default=None, help="comma-separated shape names of the grid")
    p.add_argument("--list", action="store_true", help="print the grid and exit")
    add_cpu_isa_argument(p)
    return p


def _check(parser, ns) -> None:
    ns.dtypes = [d.strip() for d in ns.dtype.split(",") if d.strip()]
    if not ns.dtypes or not set(ns.dtypes) <= set(DTYPES):
        parser.error(f"--dtype takes {','.join(DTYPES)} (comma-separated), got {ns.dtype!r}")
    for flag, value in (
        ("--repeats", ns.repeats),
        ("--num-prompts", ns.num_prompts),
        ("--max-tokens", ns.max_tokens),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if ns.vllm_python and not ns.vllm_runner:
        parser.error("--vllm-python needs --vllm-runner (run_vllm.py)")


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = _parser()
    ns = parser.parse_args(argv)
    _check(parser, ns)
    shapes = _selected(parser, ns.grid, ns.only)
    if ns.list:
        print_grid(shapes)
        return 0
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    ns.vllm_absent = vllm_absence(ns.vllm_python)
    if ns.vllm_absent:
        print(f"vLLM column absent: {ns.vllm_absent}; running ours only", flush=True)
    rows = run_sweep(ns, shapes)
    failed = [f"{r['shape']} {r['dtype']}" for r in rows if "tokens_per_s" not in r["ours"]]
    if failed:
        print(f"ours failed on: {', '.join(failed)} (logs: {ns.out_dir}/*.failed.log)")
    worst = worst_line(rows)
    print(worst, flush=True)
    for row in rows:
        for result in (row["ours"], row["vllm"]):
            result.pop("tokens", None)
            if "error" in result:
                result["summary"] = error_summary(result)
    summary = {
        "grid": ns.grid,
        "num_prompts": ns.num_prompts,
        "max_tokens": ns.max_tokens,
        "repeats": ns.repeats,
        "cpu_isa": ns.cpu_isa,
        "vllm_absent": ns.vllm_absent,
        "rows": [{**row, "ratio": ratio(row)} for row in rows],
        "worst": worst,
    }
    (ns.out_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
