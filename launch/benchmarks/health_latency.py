"""``/health`` latency of the HTTP front end while large prompts are tokenized or validated.

``python -m launch.benchmarks.health_latency [--num-prompts 8] [--prompt-bytes 1000000]
[--token-ids]`` prints the idle and the under-load latency and their ratio. How it loads the
server: docs/benchmarks.md#health-latency-under-load."""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

VOCAB_SIZE = 128


def _tokenizer(directory: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from launch.text.detokenizer import load_tokenizer

    vocab = {f"<{i}>": i for i in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    return load_tokenizer(directory)


def _engine(http, stop: threading.Event) -> None:
    from launch.serving.engine_bridge import RequestOutput

    while not stop.is_set():
        new, _ = http.bridge.take(0.01)
        for request in new:
            http.bridge.deliver(
                RequestOutput(
                    request_id=request.request_id, new_token_ids=(1,), finish_reason="length"
                )
            )


def _health_s(address: tuple[str, int]) -> float:
    start = time.perf_counter()
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    finally:
        conn.close()
    return time.perf_counter() - start


def _post(address: tuple[str, int], body: bytes, statuses: list) -> None:
    conn = http.client.HTTPConnection(*address, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        statuses.append(conn.getresponse().status)
    finally:
        conn.close()


def _probe_while(address, workers: list[threading.Thread]) -> list[float]:
    latencies = []
    deadline = time.monotonic() + 300  # bounded: the posts have their own timeouts
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        latencies.append(_health_s(address))
        time.sleep(0.02)
    return latencies


def _body(prompt_bytes: int, *, is_token_ids: bool) -> bytes:
    if is_token_ids:  # "1," per id; the last one is outside the vocabulary
        ids = [1] * max(prompt_bytes // 2 - 1, 0) + [VOCAB_SIZE]
        return json.dumps({"prompt": ids, "max_tokens": 1}, separators=(",", ":")).encode()
    words = " ".join(f"<{i % VOCAB_SIZE}>" for i in range(prompt_bytes // 5))
    return json.dumps({"prompt": words[:prompt_bytes], "max_tokens": 1}).encode()


def measure(num_prompts: int, prompt_bytes: int, *, is_token_ids: bool = False) -> dict:
    """Idle and under-load ``/health`` latencies (seconds) and the posts' HTTP statuses."""
    from launch.serving.api_server import HTTPServerThread, ServerConfig
    from launch.serving.metrics import ServerMetrics

    with tempfile.TemporaryDirectory() as directory:
        config = ServerConfig(
            model_name="m",
            max_model_len=1 << 22,
            vocab_size=VOCAB_SIZE,
            tokenizer=_tokenizer(directory),
            metrics=ServerMetrics(dp_size=1),
        )
        http = HTTPServerThread(config, host="127.0.0.1", port=0)
        address = ("127.0.0.1", http.start())
        stop = threading.Event()
        engine = threading.Thread(target=_engine, args=(http, stop), daemon=True)
        engine.start()
        try:
            # the clients run in a process of their own, as real clients do: their threads must
            # not contend for the server process's GIL
            body = _body(prompt_bytes, is_token_ids=is_token_ids)
            spawn = multiprocessing.get_context("spawn")
            with spawn.Pool(1) as pool:
                return pool.apply(_clients, (address, body, num_prompts))
        finally:
            stop.set()
            engine.join(timeout=5)
            http.stop(timeout_s=5)


def _clients(address: tuple[str, int], body: bytes, num_prompts: int) -> dict:
    """Idle probes, then ``num_prompts`` concurrent posts of ``body`` with probes until they end."""
    idle = [_health_s(address) for _ in range(20)]
    statuses: list = []
    workers = [
        threading.Thread(target=_post, args=(address, body, statuses)) for _ in range(num_prompts)
    ]
    for w in workers:
        w.start()
    loaded = _probe_while(address, workers)
    for w in workers:
        w.join(timeout=120)
    return {"idle": idle, "loaded": loaded, "statuses": statuses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.health_latency", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-bytes", type=int, default=1_000_000)
    parser.add_argument(
        "--token-ids", action="store_true", help="bodies of token ids instead of text"
    )
    ns = parser.parse_args(argv)
    result = measure(ns.num_prompts, ns.prompt_bytes, is_token_ids=ns.token_ids)
    idle, loaded = result["idle"], result["loaded"]
    print(f"statuses of the {ns.num_prompts} posts: {sorted(result['statuses'])}")
    print(f"/health idle:   max {max(idle):.4f} s, median {statistics.median(idle):.4f} s")
    print(
        f"/health loaded: max {max(loaded):.4f} s, median {statistics.median(loaded):.4f} s "
        f"({len(loaded)} probes); max ratio loaded/idle {max(loaded) / max(idle):.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
