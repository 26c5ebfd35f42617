"""Load generator for ``launch.serve`` with ``vllm bench serve``'s flags.

``python -m launch.bench_serving`` sends streaming completions from vLLM's random dataset at a
request rate and concurrency and prints vLLM's "Serving Benchmark Result" block; without
``--base-url`` it starts the server twice, DBO off then on, and compares them. Flags and output:
docs/benchmarks.md#serving-benchmark-launchbench_serving."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.benchmarks.serving import (
    METRIC_HEADERS,
    BenchResult,
    RandomRequest,
    RequestResult,
    arrival_gaps,
    percentile,
    random_requests,
)

__all__ = ["BenchResult", "RequestResult", "main", "percentile", "run_load"]

PROG = "launch.bench_serving"
SERVING_LINE = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+)")


async def _one_request(session, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    last = None
    ttft = 0.0
    itls: list[float] = []
    num_tokens = 0
    usage = None
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
                if not chunk["choices"]:  # stream_options.include_usage: the last chunk
                    usage = chunk.get("usage") or usage
                    continue
                new = _num_new_tokens(chunk["choices"][0])
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
    if usage is not None:  # chat chunks carry text, not token ids: the server's count
        num_tokens = usage["completion_tokens"]
    return RequestResult(
        ok=True,
        num_output_tokens=num_tokens,
        num_prompt_tokens=None if usage is None else usage["prompt_tokens"],
        ttft_s=ttft,
        itls_s=tuple(itls),
        latency_s=time.perf_counter() - start,
    )


def _num_new_tokens(choice: dict) -> int:
    """Tokens in one streamed choice: its ``token_ids`` (completions), or one per chat chunk
    with content (as vLLM's openai-chat backend counts chunks)."""
    if "delta" in choice:
        return int(bool(choice["delta"].get("content")))
    return len(choice.get("token_ids") or ())


def _body(request: RandomRequest, model: str | None, tokenizer) -> dict:
    """A completions body with the token ids, or (with a tokenizer) a chat body whose one user
    message is the ids' text, as vLLM's random dataset does for chat."""
    common = {"temperature": 0, "ignore_eos": True, "stream": True}
    if tokenizer is None:
        body = {
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "return_token_ids": True,
            **common,
        }
    else:
        text = tokenizer.decode(request.prompt_token_ids)
        body = {
            "messages": [{"role": "user", "content": text}],
            "max_completion_tokens": request.output_len,
            "stream_options": {"include_usage": True},
            **common,
        }
    return body if model is None else {**body, "model": model}


async def run_load(
    base_url: str,
    requests: list[RandomRequest],
    *,
    request_rate: float,
    burstiness: float = 1.0,
    max_concurrency: int | None,
    seed: int,
    endpoint: str = "/v1/completions",
    model: str | None = None,
    tokenizer=None,
    profile: bool = False,
) -> BenchResult:
    """Send the requests; gather per-request timings into a BenchResult. With ``tokenizer``
    (``launch.text.detokenizer.Tokenizer``) they go to a chat endpoint as text. ``profile``:
    ``POST /start_profile`` before the first request and ``/stop_profile`` after the last
    (untimed; RuntimeError naming the answer if the server refuses)."""
    import aiohttp

    gaps = arrival_gaps(len(requests), request_rate=request_rate, burstiness=burstiness, seed=seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    timeout = aiohttp.ClientTimeout(total=600)  # every request wait is bounded
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def limited(request):
            async with limit:
                body = _body(request, model, tokenizer)
                return await _one_request(session, base_url + endpoint, body)

        if profile:
            await _post_profile(session, base_url, "start")
        start = time.perf_counter()
        tasks = []
        for request, gap in zip(requests, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if profile:
            await _post_profile(session, base_url, "stop")
        async with session.get(base_url + "/metrics") as response:
            metrics = await response.text()
    ok = [(q, r) for q, r in zip(requests, results, strict=True) if r.ok]
    failed = [r for r in results if not r.ok]
    match = re.search(r"^moe_dbo_engine_ubatched_step_fraction (\S+)$", metrics, re.M)
    return BenchResult(
        num_ok=len(ok),
        num_failed=len(failed),
        duration_s=duration,
        num_output_tokens=sum(r.num_output_tokens for _, r in ok),
        num_input_tokens=sum(r.num_prompt_tokens or len(q.prompt_token_ids) for q, r in ok),
        ttft_s=tuple(r.ttft_s for _, r in ok),
        itl_s=tuple(x for _, r in ok for x in r.itls_s),
        tpot_s=tuple(r.tpot_s for _, r in ok if r.tpot_s is not None),
        e2el_s=tuple(r.latency_s for _, r in ok),
        ubatched_step_fraction=float(match.group(1)) if match else None,
        first_error=failed[0].error if failed else "",
    )


async def _post_profile(session, base_url: str, action: str) -> None:
    """``POST /<action>_profile``; RuntimeError naming the status and body unless 200."""
    async with session.post(f"{base_url}/{action}_profile") as response:
        if response.status != 200:
            hint = " (start the server with --profiler-config)" if response.status == 404 else ""
            body = (await response.text())[:200]
            raise RuntimeError(f"/{action}_profile answered {response.status}{hint}: {body}")


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
    p.add_argument("--host", default=None, help="with --port: the server at http://HOST:PORT")
    p.add_argument("--port", type=int, default=None)
    p.add_argument(
        "--backend",
        default="vllm",
        choices=("vllm", "openai", "openai-chat"),
        help="openai-chat: chat completions (needs --tokenizer)",
    )
    p.add_argument(
        "--endpoint", default=None, help="/v1/completions, or /v1/chat/completions with openai-chat"
    )
    p.add_argument("--model", default=None, help="model name sent with each request")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint dir whose tokenizer.json turns prompts into chat text (default: --model)",
    )
    p.add_argument("--nproc", type=int, default=2, help="DP ranks of the launched servers")
    p.add_argument("--server-args", default="", help="extra flags for the launched servers")
    _add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (inf: burst)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="max requests in flight")
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"comma-separated, of {','.join(METRIC_HEADERS)}",
    )
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--ignore-eos", action="store_true", help="accepted for vLLM; always on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the load on the server's ranks (/start_profile, /stop_profile; the server "
        "needs --profiler-config; with --base-url or --host/--port only)",
    )
    return p


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    """vLLM's random dataset: prompt and output lengths, their spread, a shared prefix."""
    p.add_argument("--dataset-name", default="random", choices=("random",))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--random-input-len",
        "--input-len",
        dest="input_len",
        type=int,
        default=32,
        help="prompt tokens per request",
    )
    p.add_argument(
        "--random-output-len",
        "--output-len",
        dest="output_len",
        type=int,
        default=32,
        help="generated tokens per request (ignore_eos)",
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)",
    )
    p.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix tokens")


def _check(ns: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Raise ValueError naming the first bad flag; the parsed metric lists."""
    for flag, value in (
        ("--num-prompts", ns.num_prompts),
        ("--random-input-len", ns.input_len),
        ("--random-output-len", ns.output_len),
        ("--nproc", ns.nproc),
        ("--max-concurrency", ns.max_concurrency or 1),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if ns.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {ns.random_prefix_len}")
    if not ns.request_rate > 0 or not ns.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    is_chat = ns.backend == "openai-chat"
    ns.endpoint = ns.endpoint or ("/v1/chat/completions" if is_chat else "/v1/completions")
    expected = "/v1/chat/completions" if is_chat else "/v1/completions"
    if ns.endpoint != expected:
        raise ValueError(f"--endpoint must be {expected} with --backend {ns.backend}")
    metrics = tuple(m.strip() for m in ns.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRIC_HEADERS]
    if unknown:
        raise ValueError(f"--percentile-metrics: {unknown} not in {', '.join(METRIC_HEADERS)}")
    try:
        percentiles = tuple(float(p) for p in ns.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles: not numbers: {ns.metric_percentiles!r}") from None
    if not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {ns.metric_percentiles}")
    if ns.host is not None or ns.port is not None:
        ns.base_url = f"http://{ns.host or '127.0.0.1'}:{ns.port or 8000}"
    if ns.base_url and not re.match(r"^http://(127\.0\.0\.1|localhost)(:\d+)?$", ns.base_url):
        raise ValueError("--base-url must be a loopback http URL")
    if ns.profile and not ns.base_url:
        raise ValueError(
            "--profile profiles a running server: give --base-url (or --host/--port) of one "
            "started with --profiler-config"
        )
    return metrics, percentiles


def _chat_tokenizer(ns: argparse.Namespace):
    """The tokenizer that turns prompts into chat text (openai-chat only), else None."""
    if ns.backend != "openai-chat":
        return None
    from launch.text.detokenizer import load_tokenizer

    path = ns.tokenizer or ns.model
    tokenizer = None if path is None else load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(
            f"--backend openai-chat needs --tokenizer DIR with a tokenizer.json, got {path}"
        )
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        metrics, percentiles = _check(ns)
        requests = random_requests(
            num_prompts=ns.num_prompts,
            input_len=ns.input_len,
            output_len=ns.output_len,
            range_ratio=ns.random_range_ratio,
            prefix_len=ns.random_prefix_len,
            vocab_low=3,
            vocab_high=100,
            seed=ns.seed,
        )
        tokenizer = _chat_tokenizer(ns)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    load = dict(
        tokenizer=tokenizer,
        request_rate=ns.request_rate,
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
        seed=ns.seed,
        endpoint=ns.endpoint,
        model=ns.model,
        profile=ns.profile,
    )
    settings = {**vars(ns), "request_rate": str(ns.request_rate)}
    print(f"{PROG}: {json.dumps(settings)}", flush=True)
    summary = dict(
        percentile_metrics=metrics,
        metric_percentiles=percentiles,
        max_concurrency=ns.max_concurrency,
    )
    if ns.base_url:
        try:
            result = asyncio.run(run_load(ns.base_url, requests, **load))
        except RuntimeError as e:  # a refused /start_profile or /stop_profile
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 1
        print(result.summary(**summary))
        if result.first_error:
            print(f"first error: {result.first_error}")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    columns = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dbo in (("DBO off", []), ("DBO on", ["--enable-dbo"])):
            flags = shlex.split(ns.server_args) + dbo
            proc, url = launch_server(ns.nproc, flags, Path(tmp) / f"{len(columns)}.log")
            try:
                columns[name] = asyncio.run(run_load(url, requests, **load))
            finally:
                stop_server(proc)
            print(f"{name}:\n{columns[name].summary(**summary)}", flush=True)
    print_table(columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
