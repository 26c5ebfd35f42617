"""The server as vLLM users meet it, through the official ``openai`` client: one
``torchrun -m launch.serve`` (2 DP ranks, EP, DBO) on a checkpoint whose tokenizer and chat
template were saved by transformers, shared by every check of this module.

Greedy results must equal offline ``launch.generate`` on the same token ids (the chat prompts'
ids come from transformers' ``apply_chat_template``); logprobs must name the greedy token as the
row's maximum; a client that disconnects mid-stream must be aborted (KV blocks freed, counted in
``/metrics``) while 16 other streams finish with the right tokens.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.helpers.chat import build_chat_tokenizer, checkpoint_with_chat_tokenizer
from tests.helpers.serve import (
    REPO,
    get,
    launch_server,
    run_offline_generate,
    wait_until_serving,
)

openai = pytest.importorskip("openai")

MAX_TOKENS = 8
# the disconnect tests' requests ask for MAX_MODEL_LEN - 4 tokens and are normally aborted after
# 3-4: the long budget (hundreds of decode steps) keeps a slow-to-notice disconnect from passing
# as a request that simply ran to its end
MAX_MODEL_LEN = 512
ENGINE_FLAGS = (
    "--dtype=float32",
    "--enable-expert-parallel",
    "--enable-dbo",
    "--dbo-decode-token-threshold=2",
    "--dbo-prefill-token-threshold=4",
    f"--max-model-len={MAX_MODEL_LEN}",
    "--block-size=4",
)
CONVERSATIONS = [
    [{"role": "user", "content": "<7> <8> <9>"}],
    [
        {"role": "system", "content": "<20> <21>"},
        {"role": "user", "content": "<30> <31> <32>"},
        {"role": "assistant", "content": "<40>"},
        {"role": "user", "content": "<50> <51>"},
    ],
]

pytestmark = pytest.mark.slow


def _completion_prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(3, 20))] for _ in range(20)]


def _chat_prompts() -> list[list[int]]:
    hf = build_chat_tokenizer()
    return [
        hf.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in CONVERSATIONS
    ]


def _set_max_position_embeddings(model_dir: Path, value: int) -> None:
    """Replace the linked ``config.json`` by a copy with ``max_position_embeddings = value``."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.unlink()
    config_path.write_text(json.dumps({**config, "max_position_embeddings": value}))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_mixtral_dir):
    """(server, model dir, offline outputs of completion prompts, of chat prompts)."""
    tmp = tmp_path_factory.mktemp("serve_openai")
    model_dir = checkpoint_with_chat_tokenizer(tiny_mixtral_dir, tmp / "model")
    _set_max_position_embeddings(Path(model_dir), MAX_MODEL_LEN)
    log = tmp / "server.log"
    # a rank's blocks hold the long request (MAX_MODEL_LEN / 4) beside 8 of 16 short streams
    proc = launch_server(
        2, f"--model={model_dir}", *ENGINE_FLAGS, "--num-gpu-blocks-override=256", log_path=log
    )
    try:
        completions, chats = _completion_prompts(), _chat_prompts()
        offline = run_offline_generate(
            tmp, model_dir, completions + chats, f"--max-tokens={MAX_TOKENS}", *ENGINE_FLAGS
        )
        srv = wait_until_serving(proc, log)
    except BaseException:
        proc.kill()
        raise
    yield srv, model_dir, offline[: len(completions)], offline[len(completions) :]
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="x", max_retries=0)


def _decode(ids: list[int]) -> str:
    return build_chat_tokenizer().decode(ids, skip_special_tokens=True)


def _metric(base_url: str, name: str) -> float:
    text = get(base_url, "/metrics")[1].decode()
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_batched_token_prompts_n2_logprobs_equal_offline(served, client):
    srv, model_dir, offline, _ = served
    prompts = _completion_prompts()[:3]
    result = client.completions.create(
        model=model_dir,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
        logprobs=3,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in result.choices] == list(range(6))
    for c in result.choices:
        expected = offline[c.index // 2]
        assert c.model_extra["token_ids"] == expected, c.index
        assert c.text == _decode(expected)
        lp = c.logprobs
        assert lp.tokens == [f"<{t}>" for t in expected]
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert logprob == max(top.values()) and top[token] == logprob  # greedy: the row's max
            assert len(top) == 3 and logprob < 0
        assert lp.text_offset[0] == 0
        assert lp.text_offset[1:] == [
            sum(map(len, lp.tokens[: i + 1])) for i in range(len(expected) - 1)
        ]
    assert result.usage.prompt_tokens == sum(map(len, prompts))
    assert result.usage.completion_tokens == 2 * sum(len(offline[i]) for i in range(3))


def test_string_prompts_echo_and_usage(served, client):
    _, model_dir, offline, _ = served
    prompts = _completion_prompts()[3:5]
    texts = [" ".join(f"<{t}>" for t in p) for p in prompts]
    result = client.completions.create(
        model=model_dir, prompt=texts, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    for i, choice in enumerate(result.choices):
        assert choice.text == texts[i] + _decode(offline[3 + i])
    assert result.usage.prompt_tokens == sum(map(len, prompts))


def test_streaming_completions_n2_with_usage(served, client):
    _, model_dir, offline, _ = served
    prompts = _completion_prompts()[5:7]
    stream = client.completions.create(
        model=model_dir,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    finish: dict[int, list] = {i: [] for i in range(4)}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        tokens[c.index] += c.model_extra["token_ids"]
        finish[c.index].append(c.finish_reason)
    for i in range(4):
        assert tokens[i] == offline[5 + i // 2], i
        assert finish[i][-1] in ("stop", "length") and not any(finish[i][:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        len(t) for t in tokens.values()
    )


def test_chat_whole_with_logprobs_equals_offline(served, client):
    _, model_dir, _, offline_chat = served
    for messages, expected, prompt_ids in zip(
        CONVERSATIONS, offline_chat, _chat_prompts(), strict=True
    ):
        result = client.chat.completions.create(
            model=model_dir,
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        (choice,) = result.choices
        assert choice.message.role == "assistant" and choice.message.content == _decode(expected)
        content = choice.logprobs.content
        assert [c.token for c in content] == [f"<{t}>" for t in expected]
        for c in content:
            assert c.logprob == c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
            assert c.top_logprobs[0].token == c.token and c.bytes == list(c.token.encode())
        assert result.usage.prompt_tokens == len(prompt_ids)
        assert result.usage.completion_tokens == len(expected)
        assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")


def test_chat_stop_string_and_include_usage(served, client):
    _, model_dir, _, offline_chat = served
    expected = offline_chat[0]
    stop = f"<{expected[2]}>"
    full = _decode(expected)
    stream = client.chat.completions.create(
        model=model_dir,
        messages=CONVERSATIONS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=[stop],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full[: full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(_chat_prompts()[0])


def test_chat_streaming_the_openai_way(served, client):
    """The issue's done-when: ``chat.completions.create(..., stream=True)`` works."""
    _, model_dir, _, offline_chat = served
    stream = client.chat.completions.create(
        model=model_dir,
        messages=CONVERSATIONS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
        stream=True,
    )
    content = {0: "", 1: ""}
    roles, finishes = {0: [], 1: []}, {0: [], 1: []}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        (c,) = chunk.choices
        roles[c.index].append(c.delta.role)
        content[c.index] += c.delta.content or ""
        finishes[c.index].append(c.finish_reason)
    for i in (0, 1):
        assert roles[i][0] == "assistant" and content[i] == _decode(offline_chat[1])
        assert finishes[i][-1] in ("stop", "length") and not any(finishes[i][:-1])


def test_top_p_seed_and_errors(served, client):
    _, model_dir, offline, _ = served
    prompt = _completion_prompts()[7]
    # a nucleus of ~0 mass holds only the most likely token: sampling equals greedy
    tiny_p = client.completions.create(
        model=model_dir,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        top_p=1e-6,
        extra_body={"return_token_ids": True},
    )
    assert tiny_p.choices[0].model_extra["token_ids"] == offline[7]
    runs = [
        client.completions.create(
            model=model_dir,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=0.9,
            seed=5,
            n=2,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        for _ in range(2)
    ]
    ids = [[c.model_extra["token_ids"] for c in r.choices] for r in runs]
    assert ids[0] == ids[1]  # seeded: reproducible
    with pytest.raises(openai.BadRequestError, match="tool messages are not supported"):
        client.chat.completions.create(
            model=model_dir, messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]
        )
    with pytest.raises(openai.BadRequestError, match="'top_p' must be in"):
        client.completions.create(model=model_dir, prompt=prompt, top_p=1.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-x", messages=CONVERSATIONS[0])


def _stream_tokens(base_url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    tokens = []
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if line.startswith("data: {"):
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    conn.close()
    return tokens


def test_disconnected_client_is_aborted_while_16_streams_finish(served):
    srv, _, offline, _ = served
    base = srv.base_url
    aborted_before = _metric(base, 'moe_dbo_requests_finished_total{finish_reason="abort"}')
    tokens_before = _metric(base, "moe_dbo_generation_tokens_total")
    long_max = MAX_MODEL_LEN - 4
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": long_max,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    prompts = _completion_prompts()[:16]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_stream_tokens, base, p, MAX_TOKENS) for p in prompts]
        received = 0
        while received < 2:  # a few tokens arrived: the request is running
            line = response.fp.readline().decode().strip()
            if line.startswith("data: {"):
                received += len(json.loads(line[6:])["choices"][0]["token_ids"])
        response.close()
        conn.close()  # the client is gone, mid-stream
        results = [f.result(timeout=120) for f in futures]
    assert results == offline[:16]
    deadline = time.monotonic() + 30
    while _metric(base, 'moe_dbo_requests_finished_total{finish_reason="abort"}') == aborted_before:
        assert time.monotonic() < deadline, "the disconnected request was never aborted"
        time.sleep(0.05)
    assert (
        _metric(base, 'moe_dbo_requests_finished_total{finish_reason="abort"}')
        == aborted_before + 1
    )
    assert _metric(base, "moe_dbo_kv_cache_usage_perc") == 0.0  # every rank freed every block
    num_aborted_tokens = (
        _metric(base, "moe_dbo_generation_tokens_total")
        - tokens_before
        - sum(map(len, offline[:16]))
    )
    print(f"aborted after {num_aborted_tokens:g} tokens ({received} received by the client)")
    assert received <= num_aborted_tokens < long_max  # stopped early, not run to max_tokens
    assert _stream_tokens(base, prompts[0], MAX_TOKENS) == offline[0]  # the server still serves


def test_disconnected_non_streaming_client_is_aborted(served):
    """Nothing is written to a non-streaming client until the end: the disconnect must be seen
    by aiohttp's handler cancellation, not by a failed write."""
    srv, _, _, _ = served
    base = srv.base_url
    aborted_before = _metric(base, 'moe_dbo_requests_finished_total{finish_reason="abort"}')
    tokens_before = _metric(base, "moe_dbo_generation_tokens_total")
    long_max = MAX_MODEL_LEN - 4
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"prompt": [5, 6, 7], "max_tokens": long_max, "temperature": 0, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while _metric(base, "moe_dbo_generation_tokens_total") < tokens_before + 2:
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.01)
    conn.close()
    while _metric(base, 'moe_dbo_requests_finished_total{finish_reason="abort"}') == aborted_before:
        if time.monotonic() >= deadline:  # say whether it ran to its end or is still running
            length = 'moe_dbo_requests_finished_total{finish_reason="length"}'
            generated = _metric(base, "moe_dbo_generation_tokens_total") - tokens_before
            raise AssertionError(
                f"the disconnected request was never aborted: {generated:g} tokens generated "
                f"since it was sent, {_metric(base, length):g} requests finished with length"
            )
        time.sleep(0.05)
    num_tokens = _metric(base, "moe_dbo_generation_tokens_total") - tokens_before
    print(f"aborted after {num_tokens:g} tokens")
    assert num_tokens < long_max and _metric(base, "moe_dbo_kv_cache_usage_perc") == 0.0


def test_bench_serving_chat_backend(served):
    """``vllm bench serve --backend openai-chat``'s flags against the chat endpoint."""
    srv, model_dir, _, _ = served
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench_serving", f"--base-url={srv.base_url}"]
        + ["--backend=openai-chat", f"--tokenizer={model_dir}", f"--model={model_dir}"]
        + ["--dataset-name=random", "--num-prompts=4", "--random-input-len=6"]
        + ["--random-output-len=5", "--max-concurrency=2", "--metric-percentiles=50,99"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^Successful requests:\s+4 *$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^Total generated tokens:\s+20 *$", proc.stdout, re.M), proc.stdout
    # the rendered template adds 4 tokens (bos, role marker, eos, generation prompt) per prompt
    assert re.search(r"^Total input tokens:\s+40 *$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^P50 TPOT \(ms\):\s+\d+\.\d\d", proc.stdout, re.M), proc.stdout
