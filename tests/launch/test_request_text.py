"""Issue 28 case 1: text that is not valid Unicode (a lone UTF-16 surrogate, which Python's json
accepts) is refused as a 400 naming the field, where requests are parsed, before the tokenizer
(HF tokenizers raises TypeError on it) or anything else sees it; the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from launch.serving.api_server import ServerConfig, build_app
from launch.serving.engine_bridge import EngineBridge, RequestOutput
from launch.serving.metrics import ServerMetrics
from launch.serving.openai_protocol import (
    ProtocolError,
    check_prompt_ids,
    parse_completion_request,
)
from launch.text.chat_template import load_chat_template
from launch.text.detokenizer import load_tokenizer
from tests.helpers.chat import build_chat_tokenizer


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ServerConfig:
    path = tmp_path_factory.mktemp("tok")
    build_chat_tokenizer().save_pretrained(str(path))
    return ServerConfig(
        model_name="m",
        max_model_len=64,
        vocab_size=128,
        tokenizer=load_tokenizer(str(path)),
        metrics=ServerMetrics(dp_size=1),
        chat_template=load_chat_template(str(path), None),
    )


def _post_raw(config: ServerConfig, path: str, data: bytes) -> tuple[int, dict, int]:
    """(status, JSON answer, engine requests submitted) for a raw JSON body; a stand-in engine
    ends every submitted request at once with one token (5)."""

    async def engine(bridge: EngineBridge, submitted: list) -> None:
        while True:  # cancelled when the answer is in
            new, _ = bridge.take(0)
            submitted += new
            for r in new:
                bridge.deliver(
                    RequestOutput(
                        request_id=r.request_id, new_token_ids=(5,), finish_reason="length"
                    )
                )
            await asyncio.sleep(0.01)

    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        submitted: list = []
        task = asyncio.create_task(engine(bridge, submitted))
        async with TestClient(TestServer(build_app(config, bridge))) as client:
            headers = {"Content-Type": "application/json"}
            response = await asyncio.wait_for(client.post(path, data=data, headers=headers), 30)
            answer = await response.json()
        task.cancel()
        return response.status, answer, len(submitted)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("path", "data", "field"),
    [
        ("/v1/completions", rb'{"prompt": "\ud800"}', "'prompt'"),
        ("/v1/completions", rb'{"prompt": ["ok", "a\udfffb"]}', "'prompt[1]'"),
        ("/v1/completions", rb'{"prompt": [1, 2], "stop": ["\ud800"]}', "'stop[0]'"),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
            "'messages[0].content'",
        ),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}',
            "'messages[0].content[0].text'",
        ),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}',
            "'messages[0].name'",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(config, path, data, field):
    status, answer, num_submitted = _post_raw(config, path, data)
    assert status == 400 and num_submitted == 0, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"].startswith(f"{field}: the text holds a lone UTF-16 surrogate"), error
    assert error["param"] == field.strip("'").split("[")[0].split(".")[0]


def test_a_surrogate_pair_is_text_and_is_served(config):
    status, answer, num_submitted = _post_raw(
        config, "/v1/completions", rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}'
    )
    assert status == 200 and num_submitted == 1, answer


def test_the_check_walks_any_depth_and_keys():
    deep: object = "\ud800"
    for _ in range(5000):  # deeper than the recursion limit: checked without recursion
        deep = [deep]
    with pytest.raises(ProtocolError, match=r"'x\[0\]\[0\]"):
        parse_completion_request({"prompt": [1], "x": deep}, model_name="m")
    with pytest.raises(ProtocolError, match="a key"):
        parse_completion_request({"prompt": [1], "\udc80": 1}, model_name="m")


# issue 35 case 3: checking every string for surrogates walked each element of a token-id body on
# the event loop (0.59 s per 1 MiB body); now a large body is checked on an executor thread, one at
# a time, and the checks do no Python work per token id


def _line_events_in_protocol(fn) -> int:
    """Python line events in launch/serving/openai_protocol.py while ``fn()`` runs."""
    count = 0

    def trace(frame, event, _arg):
        nonlocal count
        if not frame.f_code.co_filename.endswith("openai_protocol.py"):
            return None
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_checking_token_ids_does_no_python_work_per_id():
    def check(num_ids: int):
        def go():
            body = {"prompt": [1] * num_ids, "stop_token_ids": [2] * num_ids, "max_tokens": 1}
            request = parse_completion_request(body, model_name="m")
            with pytest.raises(ProtocolError, match="token id 128 is outside"):
                check_prompt_ids(
                    [*request.prompts[0], 128], max_tokens=1, vocab_size=128, max_model_len=10**9
                )

        return go

    few, many = _line_events_in_protocol(check(1000)), _line_events_in_protocol(check(300_000))
    assert many < few + 200, (few, many)  # the scans run per 32k-id slice, not per id


def test_the_largest_bodies_are_checked_off_the_event_loop_one_at_a_time(config, monkeypatch):
    """Bodies of ``RESERVED_BELOW_BYTES`` or more: one check at a time (smaller ones do not wait
    for them, ``tests/launch/test_http_guard.py``)."""
    from launch.serving import serving_completion
    from launch.serving.json_decoding import RESERVED_BELOW_BYTES

    threads: list[tuple[int, int]] = []  # (body size in ids, thread id) per parse
    running, most_running = [0], [0]
    lock = threading.Lock()

    def parse(body, **kwargs):
        is_large = len(body["prompt"]) > 1
        with lock:
            running[0] += is_large
            most_running[0] = max(most_running[0], running[0])
        time.sleep(0.05)  # holds its turn, so that the other large bodies queue behind it
        with lock:
            running[0] -= is_large
            threads.append((len(body["prompt"]), threading.get_ident()))
        return parse_completion_request(body, **kwargs)

    monkeypatch.setattr(serving_completion, "parse_completion_request", parse)
    num_large = RESERVED_BELOW_BYTES // 2  # ids: "1," each
    large = json.dumps({"prompt": [1] * num_large}, separators=(",", ":")).encode()

    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        async with TestClient(TestServer(build_app(config, bridge))) as client:
            headers = {"Content-Type": "application/json"}
            posts = [client.post("/v1/completions", data=large, headers=headers) for _ in range(4)]
            small = b'{"prompt": [1], "max_tokens": 1000}'  # refused too: no engine here
            posts.append(client.post("/v1/completions", data=small, headers=headers))
            responses = await asyncio.wait_for(asyncio.gather(*posts), 30)
            assert [r.status for r in responses] == [400] * 5, responses
        return threading.get_ident()

    loop_thread = asyncio.run(go())
    assert sorted(n for n, _ in threads) == [1] + [num_large] * 4
    assert all((thread == loop_thread) == (n == 1) for n, thread in threads), threads
    assert most_running[0] == 1


# issue 35 case 2: a text prompt is bounded by bytes before it is tokenized (text_bound)


@pytest.mark.parametrize(
    ("path", "body", "pattern", "param"),
    [
        (
            "/v1/completions",
            {"prompt": "<5> " * 2000},
            r"^prompt 0 has 8000 bytes of text",
            "prompt",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "<5> " * 2000}]},
            r"^the rendered conversation has \d+ bytes of text",
            "messages",
        ),
    ],
)
def test_a_text_too_long_to_fit_is_a_400_before_tokenizing(
    config, monkeypatch, path, body, pattern, param
):
    def encode(text, **_kwargs):
        raise AssertionError(f"encoded {len(text)} characters")

    monkeypatch.setattr(config.tokenizer, "encode", encode)
    status, answer, num_submitted = _post_raw(config, path, json.dumps(body).encode())
    assert status == 400 and num_submitted == 0, answer
    assert re.search(pattern, answer["error"]["message"]), answer
    assert "with max_model_len 64" in answer["error"]["message"]
    assert answer["error"]["param"] == param
