"""Side-by-side throughput table: moe-dbo (eager and graph mode) vs vLLM's CPU engine.

Runs ours (1 rank, and 2 ranks DP+EP) and vLLM (a separate process and venv, 1 core and 2
threads) on every checkpoint and dtype, one command at a time, and prints a markdown table of
output tokens/s with the ratios and the prompts with identical tokens. Usage, arms and tables:
docs/benchmarks.md#comparison-with-vllms-cpu-engine."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

VLLM_LINE = re.compile(r"vllm-cpu: .* \(([\d.]+) tokens/s\)")
CPU_ISAS = ("native", "avx2")
# torch's dispatch, oneDNN and MKL capped at AVX2 for both engines; ours is capped by
# MOE_DBO_CPU_ISA (docs/hardware.md), vLLM by the torch probes it reads, patched at start-up
# (avx2_peer/)
AVX2_CAPS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
AVX2_PEER_SITE = Path(__file__).resolve().parent / "avx2_peer"


def add_cpu_isa_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--cpu-isa`` flag of the side-by-side benchmarks (``cpu_isa_env``)."""
    parser.add_argument(
        "--cpu-isa",
        choices=CPU_ISAS,
        default="native",
        help="avx2: run both engines as on an AVX2-only CPU (torch, oneDNN and each engine's "
        "own kernels capped); native: what this CPU has",
    )


def cpu_isa_env(cpu_isa: str, engine: str) -> dict[str, str]:
    """Environment for ``engine`` (``"ours"`` or ``"vllm"``) under ``--cpu-isa``: nothing for
    ``native``; for ``avx2`` the caps, plus ``MOE_DBO_CPU_ISA`` for ours and, for vLLM, the
    ``avx2_peer`` directory ahead on its ``PYTHONPATH`` (its ``sitecustomize`` turns torch's
    AVX-512 / AMX probes off, so vLLM loads its ``_C_AVX2`` build)."""
    if cpu_isa == "native":
        return {}
    if engine == "ours":
        return {**AVX2_CAPS, "MOE_DBO_CPU_ISA": "avx2"}
    pythonpath = os.pathsep.join(
        p for p in (str(AVX2_PEER_SITE), os.environ.get("PYTHONPATH")) if p
    )
    return {**AVX2_CAPS, "PYTHONPATH": pythonpath}


def ours_command(model, prompts, dtype, *, ranks, eager, max_tokens, out_json, out_tokens):
    cores = "0" if ranks == 1 else ",".join(str(c) for c in range(ranks))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    flags = {
        "--model": model,
        "--dataset-name": "jsonl",
        "--dataset-path": prompts,
        "--num-prompts": str(_num_lines(prompts)),
        "--output-len": str(max_tokens),
        "--dtype": dtype,
        "--max-num-seqs": "256",
        "--output-json": out_json,
        "--output-tokens": out_tokens,
        "--num-gpu-blocks-override": str(_num_kv_blocks(prompts, max_tokens)),
    }
    cmd = ["taskset", "-c", cores, *torchrun, f"--nproc-per-node={ranks}"]
    cmd += ["-m", "launch.bench_throughput", *_flag_args(flags)]
    if ranks > 1:
        cmd += ["--data-parallel-size", str(ranks), "--enable-expert-parallel"]
    return cmd + (["--enforce-eager"] if eager else [])


def _flag_args(flags: dict[str, str]) -> list[str]:
    """``{"--flag": value, ...}`` as the command line's ``--flag value ...``, in order."""
    return [arg for flag_and_value in flags.items() for arg in flag_and_value]


def _num_lines(path: str) -> int:
    return sum(1 for line in Path(path).read_text().splitlines() if line.strip())


def _num_kv_blocks(path: str, max_tokens: int, block_size: int = 16) -> int:
    """KV blocks for every prompt + its outputs at once (the default sizes the cache for
    max-num-seqs full-length requests: ~18 GB on the medium checkpoint)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    lengths = [len(json.loads(line)["prompt_token_ids"]) + max_tokens for line in lines]
    return sum(-(-n // block_size) for n in lengths) + 16


def run_ours(ns, model, prompts, dtype, *, ranks, eager, tag) -> dict:
    out_json, out_tokens = ns.out_dir / f"{tag}.json", ns.out_dir / f"{tag}.tokens.jsonl"
    values = []
    for _ in range(ns.repeats):
        cmd = ours_command(
            model,
            prompts,
            dtype,
            ranks=ranks,
            eager=eager,
            max_tokens=ns.max_tokens,
            out_json=str(out_json),
            out_tokens=str(out_tokens),
        )
        # graph mode is off by default on CPU: MOE_DBO_GRAPH_MODE=1 turns on the default buckets
        graph_mode = "0" if eager else "1"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MOE_DBO_GRAPH_MODE": graph_mode,
            **_pythonpath(),
            **cpu_isa_env(ns.cpu_isa, "ours"),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            log = ns.out_dir / f"{tag}.failed.log"  # the whole output, for the post-mortem
            log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
            return {"error": proc.stderr[-500:], "log": str(log)}
        values.append(json.loads(out_json.read_text())["output_tokens_per_second"])
    tokens = [json.loads(line)["output_token_ids"] for line in out_tokens.read_text().splitlines()]
    return {"tokens_per_s": statistics.median(values), "runs": values, "tokens": tokens}


def earlier_vllm_result(ns, name: str, dtype: str, key: str, tag: str) -> dict | None:
    """vLLM's result for (checkpoint, dtype, arm) from an earlier run's ``table.json``
    (``--vllm-results``), with its tokens from the ``{tag}.json`` beside it; None if absent."""
    for table in ns.vllm_results:
        for row in json.loads(Path(table).read_text()):
            if row["checkpoint"] == name and row["dtype"] == dtype and key in row:
                result = dict(row[key])
                tokens = Path(table).parent / f"{tag}.json"
                if "tokens_per_s" in result and tokens.exists():
                    result["tokens"] = json.loads(tokens.read_text())
                return {**result, "from": str(table)}
    return None


def run_vllm(ns, model, prompts, dtype, *, threads, compile_, tag) -> dict:
    out = ns.out_dir / f"{tag}.json"
    flags = {
        "--model": model,
        "--prompts": prompts,
        "--max-tokens": str(ns.max_tokens),
        "--threads": threads,
        "--dtype": dtype,
        "--repeats": str(ns.repeats),
        "--output-json": str(out),
    }
    cmd = ["taskset", "-c", threads.replace("-", ","), ns.vllm_python, ns.vllm_runner]
    cmd += _flag_args(flags)
    proc = subprocess.run(
        cmd + (["--compile"] if compile_ else []),
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, **cpu_isa_env(ns.cpu_isa, "vllm")},
    )
    match = VLLM_LINE.search(proc.stdout)
    if proc.returncode != 0 or not match:
        log = ns.out_dir / f"{tag}.failed.log"  # the whole output, for the post-mortem
        log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        return {"error": (proc.stderr or proc.stdout)[-500:], "log": str(log)}
    return {"tokens_per_s": float(match.group(1)), "tokens": json.loads(out.read_text())}


def _pythonpath() -> dict:
    return {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def format_rate(result: dict) -> str:
    """A run's tokens/s for a table cell: "-" if skipped, "failed" if it has no rate."""
    if "skipped" in result:
        return "-"
    return f"{result['tokens_per_s']:,.1f}" if "tokens_per_s" in result else "failed"


def same_tokens(a: dict, b: dict) -> str:
    """ "k/n": of ``b``'s n prompts, how many got the same tokens in ``a``; "-" if either run has
    no tokens."""
    if "tokens" not in a or "tokens" not in b:
        return "-"
    return (
        f"{sum(x == y for x, y in zip(a['tokens'], b['tokens'], strict=False))}/{len(b['tokens'])}"
    )


# (table key, file suffix, CPUs, torch.compile) of the three vLLM runs per checkpoint and dtype
VLLM_ARMS = (
    ("vllm_eager", "eager", "0", False),
    ("vllm_compiled", "compiled", "0", True),
    ("vllm_2threads", "2t", "0-1", False),
)

# (table key, file suffix, DP ranks, eager) of our four runs per checkpoint and dtype
OURS_ARMS = (
    ("ours_eager", "eager", 1, True),
    ("ours_graph", "graph", 1, False),
    ("ours_2ranks_eager", "2r_eager", 2, True),
    ("ours_2ranks_graph", "2r_graph", 2, False),
)


def table_rows(ns) -> list[dict]:
    rows = []
    for spec in ns.checkpoint:
        name, paths = spec.split("=", 1)
        model, prompts = paths.split(":", 1)
        for dtype in ns.dtypes:
            tag = f"{name}_{dtype}"
            r = {"checkpoint": name, "dtype": dtype}
            vllm = {
                key: earlier_vllm_result(ns, name, dtype, key, f"{tag}_vllm_{suffix}")
                or ({"skipped": True} if "vllm" not in ns.engines else None)
                or run_vllm(
                    ns,
                    model,
                    prompts,
                    dtype,
                    threads=threads,
                    compile_=compile_,
                    tag=f"{tag}_vllm_{suffix}",
                )
                for key, suffix, threads, compile_ in VLLM_ARMS
            }
            r.update(vllm)
            for key, suffix, ranks, eager in OURS_ARMS:
                r[key] = (
                    run_ours(
                        ns,
                        model,
                        prompts,
                        dtype,
                        ranks=ranks,
                        eager=eager,
                        tag=f"{tag}_ours_{suffix}",
                    )
                    if "ours" in ns.engines
                    else {"skipped": True}
                )
            print(format_row(r), flush=True)
            rows.append(r)
    return rows


def format_ratio(ours: float, vllm: float) -> str:
    """``ours / vllm`` as "1.23x"; "-" if either is 0 (missing)."""
    return f"{ours / vllm:.2f}x" if ours and vllm else "-"


def format_row(r: dict) -> str:
    best = max((r[k].get("tokens_per_s", 0) for k in ("vllm_eager", "vllm_compiled")), default=0)
    ours = max(r[k].get("tokens_per_s", 0) for k in ("ours_eager", "ours_graph"))
    two = max(r[k].get("tokens_per_s", 0) for k in ("ours_2ranks_eager", "ours_2ranks_graph"))
    v2 = r["vllm_2threads"].get("tokens_per_s", 0)
    # vLLM's tokens from whichever 1-core arm ran (eager fails with SIGILL in bf16 on some CPUs)
    vllm_tokens = next((r[k] for k in ("vllm_eager", "vllm_compiled") if "tokens" in r[k]), {})
    cell = {k: format_rate(v) for k, v in r.items() if isinstance(v, dict)}
    return (
        f"| {r['checkpoint']}, {r['dtype']} | {cell['vllm_eager']} / {cell['vllm_compiled']} "
        f"| {cell['ours_eager']} / {cell['ours_graph']} | {format_ratio(ours, best)} "
        f"| {cell['vllm_2threads']} | {cell['ours_2ranks_eager']} / "
        f"{cell['ours_2ranks_graph']} | {format_ratio(two, v2)} "
        f"| {same_tokens(r['ours_eager'], vllm_tokens)} |"
    )


HEADER = (
    "| checkpoint, dtype | vLLM 1 core eager / compiled | ours 1 rank eager / graph | ours/vLLM "
    "| vLLM 2 threads | ours 2 ranks eager / graph | ours/vLLM | same tokens |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="launch.benchmarks.peer_table", description=__doc__.split("\n")[0]
    )
    p.add_argument("--checkpoint", action="append", required=True, help="NAME=MODEL_DIR:PROMPTS")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--vllm-runner", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument(
        "--vllm-results",
        nargs="*",
        default=[],
        metavar="TABLE_JSON",
        help="take vLLM's numbers (and tokens, from the files beside it) from an earlier run's "
        "table.json instead of running vLLM again; rows not found there are run",
    )
    p.add_argument(
        "--engines",
        default="vllm,ours",
        help="which engines to run, comma-separated: vllm, ours (e.g. measure vLLM once with "
        "'vllm', then ours against it with 'ours' and --vllm-results)",
    )
    add_cpu_isa_argument(p)
    ns = p.parse_args(argv)
    ns.engines = {e.strip() for e in ns.engines.split(",") if e.strip()}
    if not ns.engines or not ns.engines <= {"vllm", "ours"}:
        p.error(f"--engines takes 'vllm', 'ours' or both, got {','.join(sorted(ns.engines))!r}")
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    rows = table_rows(ns)
    for r in rows:
        for v in r.values():
            if isinstance(v, dict):
                v.pop("tokens", None)
    (ns.out_dir / "table.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
