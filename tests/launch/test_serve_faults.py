"""Fault tests of the server end to end on loopback (2 DP ranks, EP, DBO), each bounded in time.

- Poison among 32 concurrent normal requests: a seed beyond the generator's range (400), a
  temperature of 1e-300 (vLLM's rule: greedy), a prompt whose logits are NaN (the checkpoint's
  embedding of one token is NaN: its sampling fails), ``stop`` without a tokenizer (400). All 32
  normal requests get transformers' greedy tokens (float64 on both sides), the NaN request alone
  fails with a JSON error, and the server keeps serving.
- A frozen rank (SIGSTOP) with ``--distributed-timeout 5``: the in-flight stream ends with an error
  event and rank 0 exits with one line naming the collective and the silent rank, within the
  timeout plus a few seconds.
- Rank 0 SIGKILLed after a large body: its JSON decoder processes end with it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import hf_greedy
from tests.helpers.precision import reference_model
from tests.helpers.serve import get, launch_server, post, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
FLAGS = (
    "--data-parallel-size=2",
    "--enable-expert-parallel",
    "--enable-dbo",
    "--dbo-decode-token-threshold=2",
    "--dbo-prefill-token-threshold=4",
    "--max-model-len=64",
    "--block-size=4",
)


def _prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(3, 20))] for _ in range(33)]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, tiny_mixtral_dir):
    """(checkpoint dir whose embedding row of one token is NaN, that token, 33 prompts without it,
    transformers' float64 greedy continuations of them on the clean checkpoint)."""
    from safetensors.torch import load_file, save_file

    prompts = _prompts()
    expected = hf_greedy(reference_model(tiny_mixtral_dir), prompts, max_new_tokens=MAX_TOKENS)
    used = {t for seq in prompts + expected for t in seq}
    nan_token = next(t for t in range(3, 128) if t not in used)  # no normal request meets it
    path = tmp_path_factory.mktemp("nan_embedding")
    for item in Path(tiny_mixtral_dir).iterdir():
        shutil.copy(item, path / item.name)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = path / index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][nan_token] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path), nan_token, prompts, expected


def _metric(text: str, name: str, label: str) -> float:
    match = re.search(rf"^{name}{{{label}}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_poison_requests_fail_alone_among_32_concurrent(tmp_path, poisoned):
    model_dir, nan_token, prompts, expected = poisoned
    server = start_server(
        2, f"--model={model_dir}", "--dtype=float64", *FLAGS[1:], log_path=tmp_path / "log"
    )
    try:
        normal = [
            {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
            for p in prompts[:32]
        ]
        poison = [
            {"prompt": [5, 6], "max_tokens": 4, "temperature": 0.5, "seed": 2**64},
            {**normal[0], "prompt": prompts[32], "temperature": 1e-300},
            {"prompt": [5, nan_token, 7], "max_tokens": 4, "temperature": 0.7, "seed": 1},
            {"prompt": [5, 6], "max_tokens": 4, "stop": ["x"]},
        ]
        bodies = normal[:16] + poison + normal[16:]  # the poison in the middle of the load
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(server.base_url, "/v1/completions", b), bodies))
        normal_answers = answers[:16] + answers[20:]
        for i, (status, body) in enumerate(normal_answers):
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == expected[i], i
        seed, tiny, nan, stop = answers[16:20]
        assert (
            seed[0] == 400
            and "'seed' must be in [-2**63, 2**63 - 1]" in seed[1]["error"]["message"]
        )
        assert tiny[0] == 200 and tiny[1]["choices"][0]["token_ids"] == expected[32]
        assert nan[0] == 500 and nan[1]["error"]["message"] == (
            "the model produced NaN logits for this request"
        )
        assert stop[0] == 400 and "need the checkpoint's tokenizer" in stop[1]["error"]["message"]
        # the server still answers, and counted the failure
        status, body = post(server.base_url, "/v1/completions", normal[3])
        assert status == 200 and body["choices"][0]["token_ids"] == expected[3]
        assert get(server.base_url, "/health")[0] == 200
        metrics = get(server.base_url, "/metrics")[1].decode()
        assert _metric(metrics, "moe_dbo_requests_finished_total", 'finish_reason="error"') == 1
        _abandon_a_stream(server.base_url)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            metrics = get(server.base_url, "/metrics")[1].decode()
            if _metric(metrics, "moe_dbo_requests_finished_total", 'finish_reason="abort"'):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the abandoned stream was never counted as aborted:\n{metrics}")
    finally:
        server.stop()
    log = server.log()
    assert "launch.serve [rank 0]: stopped" in log and "launch.serve [rank 1]: stopped" in log, log
    assert "unhandled error" not in log, log  # the abandoned stream is not a server error


def _abandon_a_stream(base_url: str) -> None:
    """Start a long stream, read its first event, close the connection."""
    body = {"prompt": [5, 6], "max_tokens": 50, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.readline().startswith(b"data: {")


def test_a_frozen_rank_is_named_within_the_timeout(tmp_path, tiny_mixtral_dir):
    timeout_s = 5
    server = start_server(
        2,
        f"--model={tiny_mixtral_dir}",
        "--dtype=float32",
        *FLAGS[1:],
        f"--distributed-timeout={timeout_s}",
        log_path=tmp_path / "log",
    )
    children = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    rank1 = sorted(map(int, children))[1]  # started second
    body = {"prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.readline().startswith(b"data: {")
            os.kill(rank1, signal.SIGSTOP)
            frozen_at = time.monotonic()
            events = [line.decode().strip() for line in response if line.strip()]
        answered_after = time.monotonic() - frozen_at
        error_line = _wait_for(server, r"launch\.serve \[rank 0\]: error: .*", timeout_s + 30)
        reported_after = time.monotonic() - frozen_at
    finally:
        os.kill(rank1, signal.SIGCONT)  # lets torchrun's SIGTERM end it
        server.stop()
    print(
        f"frozen rank 1: stream ended {answered_after:.1f} s, "
        f"rank 0 reported {reported_after:.1f} s"
    )
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 500 and "rank(s) 1 stopped answering" in error["message"], error
    assert (
        "did not complete within 5 s" in error_line and "rank(s) 1 stopped answering" in error_line
    )
    assert re.search(r"control exchange|DP vote|dispatch|combine", error_line), error_line
    # the collective's timeout, the 0.6 s heartbeat diagnosis, and slack for a loaded machine
    assert answered_after < timeout_s + 10 and reported_after < timeout_s + 12, (
        answered_after,
        reported_after,
    )


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return sorted(map(int, found.stdout.split()))


def _is_gone(pid: int) -> bool:
    """Exited (a zombie waits only for its reaping)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def test_the_json_decoder_processes_end_with_a_sigkilled_rank_0(tmp_path, tiny_mixtral_dir):
    server = start_server(
        2, f"--model={tiny_mixtral_dir}", "--dtype=float32", *FLAGS[1:], log_path=tmp_path / "log"
    )
    decoders: list[int] = []
    try:
        rank0 = _children(server.proc.pid)[0]  # started first
        body = json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode() + b" " * (70 * 1024)
        assert post(server.base_url, "/v1/completions", body)[0] == 200  # decoded in a worker
        decoders = _children(rank0)
        assert decoders, "rank 0 has no decoder process"
        os.kill(rank0, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not all(map(_is_gone, decoders)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in decoders if not _is_gone(pid)] == []
    finally:
        server.stop()
        for pid in decoders:  # ours, if they outlived rank 0
            if not _is_gone(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_for(server, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, server.log())
        if match:
            return match.group(0)
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the log within {timeout} s:\n{server.log()[-3000:]}")


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--timeline-dir=/proc/nonexist",), r"--timeline-dir '/proc/nonexist' is not writable"),
        (("--shutdown-timeout=nan",), r"--shutdown-timeout must be in \[0, 3600\] s, got nan"),
        (("--seed=18446744073709551616",), r"--seed must be in \[-2\*\*63, 2\*\*63 - 1\]"),
    ],
)
def test_bad_flags_are_refused_before_the_server_starts(tmp_path, args, pattern):
    log_path = tmp_path / "log"
    proc = launch_server(2, *args, log_path=log_path)
    assert proc.wait(timeout=120) != 0
    log = log_path.read_text()
    errors = re.findall(r"^launch\.serve \[rank \d\]: error: .*$", log, re.M)
    assert errors and all(re.search(pattern, line) for line in errors), log[-3000:]
    assert "serving" not in log
