"""The server end to end on loopback: one ``torchrun -m launch.serve`` (2 DP ranks, EP, DBO) shared
by the checks of this module, the last of which stops it with SIGTERM.

The KV cache is made small (``--num-gpu-blocks-override``) so that 32 concurrent requests force
preemption, the prefill DBO threshold low so that steps are microbatched and the decode threshold
``auto`` (adaptive DBO explores both arms); every greedy response must still equal offline
``launch.generate`` for the same prompt.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.serve import (
    REPO,
    get,
    launch_server,
    post,
    run_offline_generate,
    start_server,
    stream,
    wait_until_serving,
)

MAX_TOKENS = 8
MAX_MODEL_LEN = 64
ENGINE_FLAGS = (
    "--dtype=float32",
    "--enable-expert-parallel",
    "--enable-dbo",
    "--dbo-decode-token-threshold=auto",
    "--dbo-prefill-token-threshold=4",
    f"--max-model-len={MAX_MODEL_LEN}",
    "--block-size=4",
)
SERVER_FLAGS = ("--num-gpu-blocks-override=40", "--shutdown-timeout=20")

pytestmark = pytest.mark.slow


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(3, 30))] for _ in range(32)]


def _write_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json for the tiny vocabulary: token ``i`` is the word ``<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(128)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_mixtral_dir) -> str:
    """The tiny checkpoint plus a tokenizer.json (files linked, not copied)."""
    path = tmp_path_factory.mktemp("tiny_with_tokenizer")
    for item in Path(tiny_mixtral_dir).iterdir():
        (path / item.name).symlink_to(item)
    _write_tokenizer(path / "tokenizer.json")
    return str(path)


def _profiler_config(tmp: Path) -> dict:
    """The server's ``--profiler-config``: traces in ``tmp/profile``, uncompressed."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(tmp / "profile"),
        "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False,
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    """(server, offline outputs): the server starts while the offline reference runs."""
    tmp = tmp_path_factory.mktemp("serve")
    log = tmp / "server.log"
    proc = launch_server(
        2,
        f"--model={model_dir}",
        f"--timeline-dir={tmp / 'timeline'}",
        f"--profiler-config={json.dumps(_profiler_config(tmp))}",
        *ENGINE_FLAGS,
        *SERVER_FLAGS,
        log_path=log,
    )
    try:
        offline = run_offline_generate(
            tmp, model_dir, _prompts(), f"--max-tokens={MAX_TOKENS}", *ENGINE_FLAGS
        )
        srv = wait_until_serving(proc, log)
    except BaseException:
        proc.kill()
        raise
    yield srv, offline
    srv.stop()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def offline_outputs(served):
    return served[1]


def _complete(base_url: str, prompt, **extra) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return post(base_url, "/v1/completions", body)


def _metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_32_concurrent_requests_equal_offline_generate(server, offline_outputs):
    prompts = _prompts()
    with ThreadPoolExecutor(32) as pool:
        results = list(
            pool.map(lambda p: _complete(server.base_url, p, return_token_ids=True), prompts)
        )
    for i, (status, body) in enumerate(results):
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == offline_outputs[i], i
        assert choice["finish_reason"] in ("length", "stop")
        assert body["usage"]["completion_tokens"] == len(offline_outputs[i])
        assert choice["text"] == " ".join(f"<{t}>" for t in offline_outputs[i])
    status, text = get(server.base_url, "/metrics")
    metrics = text.decode()
    assert status == 200
    assert _metric(metrics, 'moe_dbo_requests_routed_total{dp_rank="0"}') >= 8
    assert _metric(metrics, 'moe_dbo_requests_routed_total{dp_rank="1"}') >= 8
    assert _metric(metrics, "moe_dbo_num_preemptions") > 0  # the small KV cache was exercised
    assert _metric(metrics, "moe_dbo_engine_ubatched_steps_total") > 0
    assert _metric(metrics, "moe_dbo_generation_tokens_total") >= sum(map(len, offline_outputs))
    # the adaptive decode policy reports its crossover (a number, +Inf or NaN) and its exploration
    assert re.search(r'^moe_dbo_adaptive_crossover_tokens\{kind="decode"\} \S+$', metrics, re.M)
    assert 'moe_dbo_adaptive_crossover_tokens{kind="prefill"}' not in metrics  # static here
    assert _metric(metrics, "moe_dbo_adaptive_exploration_steps") > 0


def test_streaming_returns_the_same_tokens(server, offline_outputs):
    prompts = _prompts()
    for i in (0, 5):
        events = stream(
            server.base_url,
            {
                "prompt": prompts[i],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == offline_outputs[i]
        assert "".join(c["choices"][0]["text"] for c in chunks).split() == [
            f"<{t}>" for t in offline_outputs[i]
        ]
        assert [c["choices"][0]["finish_reason"] is not None for c in chunks][-1]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_text_prompt_and_stop_string(server, offline_outputs):
    prompt = _prompts()[3]
    text_prompt = " ".join(f"<{t}>" for t in prompt)
    status, body = _complete(server.base_url, text_prompt, return_token_ids=True)
    assert status == 200 and body["choices"][0]["token_ids"] == offline_outputs[3]
    full = body["choices"][0]["text"]
    stop = f"<{offline_outputs[3][2]}>"
    status, body = _complete(server.base_url, text_prompt, stop=[stop])
    assert status == 200
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


BAD_REQUESTS = {
    "not json": (b'{"prompt": [1, 2', 400, "not valid JSON"),
    "no prompt": ({"max_tokens": 4}, 400, "'prompt' is required"),
    "prompt of floats": ({"prompt": [1.5, 2]}, 400, "list of token ids"),
    "prompt too long": ({"prompt": [5] * MAX_MODEL_LEN}, 400, "maximum context length is 64"),
    "no room for max_tokens": (
        {"prompt": [5] * 60, "max_tokens": 8},
        400,
        "maximum context length is 64",
    ),
    "max_tokens 0": ({"prompt": [5], "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    "bad temperature": ({"prompt": [5], "temperature": -1}, 400, "'temperature' must be in"),
    "token outside vocab": ({"prompt": [5, 128]}, 400, r"token id 128 is outside \[0, 128\)"),
    "empty prompt": ({"prompt": []}, 400, "the prompt is empty"),
    "unknown model": ({"prompt": [5], "model": "gpt-x"}, 404, "does not exist"),
    "n=0": ({"prompt": [5], "n": 0}, 400, r"'n' must be in \[1, 64\]"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, offline_outputs, case):
    body, status, pattern = BAD_REQUESTS[case]
    code, answer = post(server.base_url, "/v1/completions", body)
    assert code == status, answer
    assert answer["error"]["code"] == status and re.search(pattern, answer["error"]["message"])
    code, answer = _complete(server.base_url, _prompts()[1], return_token_ids=True)
    assert code == 200 and answer["choices"][0]["token_ids"] == offline_outputs[1]


def test_models_and_health(server, model_dir):
    status, body = get(server.base_url, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = get(server.base_url, "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == model_dir
    assert json.loads(body)["data"][0]["max_model_len"] == MAX_MODEL_LEN


def _bench_serving(server, *flags: str) -> subprocess.CompletedProcess:
    """``launch.bench_serving`` against ``server`` with ``flags``; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench_serving", f"--base-url={server.base_url}", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_bench_serving_against_the_running_server(server):
    proc = _bench_serving(
        server,
        *["--dataset-name=random", "--num-prompts=6", "--random-input-len=5"],
        *["--random-output-len=4", "--request-rate=50", "--max-concurrency=4"],
        *["--percentile-metrics=ttft,tpot,itl,e2el", "--metric-percentiles=50,99"],
    )
    assert "============ Serving Benchmark Result ============" in proc.stdout, proc.stdout
    assert re.search(r"^Successful requests:\s+6 *$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^Total generated tokens:\s+24 *$", proc.stdout, re.M), proc.stdout
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P50", "P99"):
            assert re.search(rf"^{stat} {metric} \(ms\):\s+\d+\.\d\d", proc.stdout, re.M)


def test_bench_serving_profile_writes_every_ranks_trace_of_the_load(server):
    """``--profile``: /start_profile before the load, /stop_profile after; each rank's trace has
    the steps that served it."""
    profile_dir = server.log_path.parent / "profile"
    assert not profile_dir.exists() or not any(profile_dir.iterdir())  # nothing before a start
    proc = _bench_serving(
        server, "--num-prompts=4", "--random-input-len=5", "--random-output-len=4", "--profile"
    )
    assert re.search(r"^Successful requests:\s+4 *$", proc.stdout, re.M), proc.stdout
    for rank in (0, 1):
        (trace,) = profile_dir.glob(f"rank{rank}.*.pt.trace.json")
        names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
        assert names.count("step") >= 4, rank  # 4 output tokens per request at least
        assert "layer0.experts" in names
        assert (profile_dir / f"profiler_out_{rank}.txt").is_file()


def test_sigterm_finishes_in_flight_requests_and_ends_every_rank(server):
    """Last in this module: it stops the shared server."""
    results = {}

    def long_request():
        body = {"prompt": [5, 6, 7], "max_tokens": 50, "temperature": 0, "ignore_eos": True}
        results["long"] = post(server.base_url, "/v1/completions", body)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # the request is in flight
    start = time.monotonic()
    server.proc.terminate()  # torchrun passes SIGTERM to every rank
    server.proc.wait(timeout=60)
    elapsed = time.monotonic() - start
    thread.join(timeout=30)
    status, body = results["long"]
    assert status == 200, body  # finished, not dropped
    assert body["usage"]["completion_tokens"] == 50
    log = server.log()
    assert "launch.serve [rank 0]: stopped" in log and "launch.serve [rank 1]: stopped" in log, log
    assert "0 in-flight request(s) failed" in log
    for rank in (0, 1):  # --timeline-dir: each rank wrote the steps it served
        trace = json.loads((server.log_path.parent / "timeline" / f"rank{rank}.json").read_text())
        assert any(e.get("name") == "step" for e in trace["traceEvents"]), rank
    assert elapsed < 30, log
    with pytest.raises(OSError):
        get(server.base_url, "/health", timeout=5)


def test_a_rank_that_dies_ends_every_rank_with_an_error(tmp_path, tiny_mixtral_dir):
    """SIGKILL rank 1 while a request streams: the stream ends with an explicit error event and
    rank 0 exits with an error line within seconds (no hang)."""
    srv = start_server(
        2, f"--model={tiny_mixtral_dir}", *ENGINE_FLAGS[:-2], log_path=tmp_path / "log"
    )
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        srv.base_url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            first = response.readline()
            assert first.startswith(b"data: {"), first
            children = subprocess.run(
                ["pgrep", "-P", str(srv.proc.pid)], capture_output=True, text=True, check=True
            ).stdout.split()
            os.kill(sorted(map(int, children))[1], 9)  # rank 1 (started second)
            events = [line.decode().strip() for line in response if line.strip()]
        assert srv.proc.wait(timeout=60) != 0
    finally:
        srv.stop()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert "the engine failed" in error["message"] and error["code"] == 500, error
    assert re.search(r"launch\.serve \[rank 0\]: error: ", srv.log()), srv.log()
