"""Load generator for ``launch.serve``: ``python -m launch.bench_serving``.

Sends ``--num-prompts`` streaming completion requests (random token-id prompts of ``--input-len``
tokens, exactly ``--output-len`` generated tokens each via ``ignore_eos``) to a loopback server, at
``--request-rate`` requests/s (Poisson arrivals; ``inf``: all at once) with at most
``--max-concurrency`` in flight, and reports throughput, time to first token (TTFT) and
inter-token latency (ITL), median and p99, after vLLM's ``benchmarks/benchmark_serving.py``.

Without ``--base-url`` it launches the server twice with torchrun (``--nproc-per-node N``, EP on),
DBO off then on, runs the same load against each, and prints both side by side with the on/off
ratio. Extra server flags go in ``--server-args``. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROG = "launch.bench_serving"
SERVING_LINE = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    ok: bool
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    itls_s: tuple[float, ...] = ()  # gaps between consecutive streamed tokens
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    num_ok: int
    num_failed: int
    duration_s: float
    num_output_tokens: int
    num_input_tokens: int
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    ubatched_step_fraction: float | None
    first_error: str = ""

    def rows(self) -> dict[str, str]:
        def ms(values, q):
            return f"{percentile(values, q) * 1e3:.1f}" if values else "n/a"

        frac = self.ubatched_step_fraction
        return {
            "requests ok / failed": f"{self.num_ok} / {self.num_failed}",
            "duration (s)": f"{self.duration_s:.2f}",
            "request throughput (req/s)": f"{self.num_ok / self.duration_s:.2f}",
            "output throughput (tok/s)": f"{self.num_output_tokens / self.duration_s:.1f}",
            "total throughput (tok/s)": (
                f"{(self.num_output_tokens + self.num_input_tokens) / self.duration_s:.1f}"
            ),
            "TTFT median (ms)": ms(self.ttft_s, 50),
            "TTFT p99 (ms)": ms(self.ttft_s, 99),
            "ITL median (ms)": ms(self.itl_s, 50),
            "ITL p99 (ms)": ms(self.itl_s, 99),
            "steps microbatched (%)": "n/a" if frac is None else f"{100 * frac:.0f}",
        }


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return (
        statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]
        if q < 100
        else ordered[-1]
    )


async def _one_request(session, url: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    last = None
    ttft = 0.0
    itls: list[float] = []
    num_tokens = 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return RequestResult(
                    ok=False, error=f"HTTP {response.status}: {await response.text()}"
                )
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"])
                new = len(chunk["choices"][0].get("token_ids") or ())
                if new == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft = now - start
                else:
                    itls.append((now - last) / new)
                last = now
                num_tokens += new
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    return RequestResult(ok=True, num_output_tokens=num_tokens, ttft_s=ttft, itls_s=tuple(itls))


async def run_load(
    base_url: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    max_concurrency: int,
    seed: int,
) -> BenchResult:
    """Send the requests; gather per-request timings into a BenchResult."""
    import aiohttp

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 100) for _ in range(input_len)] for _ in range(num_prompts)]
    gaps = [0.0 if request_rate == float("inf") else rng.expovariate(request_rate) for _ in prompts]
    limit = asyncio.Semaphore(max_concurrency)
    timeout = aiohttp.ClientTimeout(total=600)  # every request wait is bounded
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def limited(prompt):
            async with limit:
                return await _one_request(session, base_url + "/v1/completions", prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        async with session.get(base_url + "/metrics") as response:
            metrics = await response.text()
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    match = re.search(r"^moe_dbo_engine_ubatched_step_fraction (\S+)$", metrics, re.M)
    return BenchResult(
        num_ok=len(ok),
        num_failed=len(failed),
        duration_s=duration,
        num_output_tokens=sum(r.num_output_tokens for r in ok),
        num_input_tokens=input_len * len(ok),
        ttft_s=tuple(r.ttft_s for r in ok),
        itl_s=tuple(x for r in ok for x in r.itls_s),
        ubatched_step_fraction=float(match.group(1)) if match else None,
        first_error=failed[0].error if failed else "",
    )


def launch_server(nproc: int, flags: list[str], log_path: Path, timeout_s: float = 300):
    """Start ``torchrun -m launch.serve`` on a free loopback port; (process, base URL)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "launch.serve", "--host=127.0.0.1", "--port=0"]
    cmd += [f"--data-parallel-size={nproc}", "--enable-expert-parallel", *flags]
    log = open(log_path, "wb")  # noqa: SIM115 - the server writes to it until it exits
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # poll the log for the serving line, with a deadline
        match = SERVING_LINE.search(log_path.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start; its log:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def print_table(columns: dict[str, BenchResult]) -> None:
    names = list(columns)
    rows = {name: result.rows() for name, result in columns.items()}
    labels = list(next(iter(rows.values())))
    width = max(map(len, labels)) + 2
    print(f"{'':<{width}}" + "".join(f"{n:>14}" for n in names))
    for label in labels:
        print(f"{label:<{width}}" + "".join(f"{rows[n][label]:>14}" for n in names))
    if len(names) == 2:
        a, b = (columns[n] for n in names)
        ratio = (b.num_output_tokens / b.duration_s) / max(a.num_output_tokens / a.duration_s, 1e-9)
        print(
            f"{'output throughput ratio':<{width}}{f'{names[1]} / {names[0]} = {ratio:.2f}x':>28}"
        )
    for name, result in columns.items():
        if result.first_error:
            print(f"{name}: first error: {result.first_error}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="bench this running server (loopback) only")
    p.add_argument("--nproc", type=int, default=2, help="DP ranks of the launched servers")
    p.add_argument("--server-args", default="", help="extra flags for the launched servers")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (inf: burst)")
    p.add_argument("--max-concurrency", type=int, default=64, help="max requests in flight")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    for flag, value in (("--num-prompts", ns.num_prompts), ("--input-len", ns.input_len),
                        ("--output-len", ns.output_len), ("--max-concurrency", ns.max_concurrency),
                        ("--nproc", ns.nproc)):  # fmt: skip
        if value < 1:
            print(f"{PROG}: error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if not ns.request_rate > 0:
        print(f"{PROG}: error: --request-rate must be > 0, got {ns.request_rate}", file=sys.stderr)
        return 2
    if ns.base_url and not re.match(r"^http://(127\.0\.0\.1|localhost)(:\d+)?$", ns.base_url):
        print(f"{PROG}: error: --base-url must be a loopback http URL", file=sys.stderr)
        return 2
    load = dict(
        num_prompts=ns.num_prompts,
        input_len=ns.input_len,
        output_len=ns.output_len,
        request_rate=ns.request_rate,
        max_concurrency=ns.max_concurrency,
        seed=ns.seed,
    )
    print(f"{PROG}: {json.dumps(load)}", flush=True)
    if ns.base_url:
        print_table({"server": asyncio.run(run_load(ns.base_url, **load))})
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    columns = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dbo in (("DBO off", []), ("DBO on", ["--enable-dbo"])):
            flags = shlex.split(ns.server_args) + dbo
            proc, url = launch_server(ns.nproc, flags, Path(tmp) / f"{len(columns)}.log")
            try:
                columns[name] = asyncio.run(run_load(url, **load))
            finally:
                stop_server(proc)
    print_table(columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
