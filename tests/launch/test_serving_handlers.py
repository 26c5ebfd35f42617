"""The chat and completions handlers in process (aiohttp test server, no engine): requests that
must be refused before anything reaches the engine get a clear 400; a request whose client goes
away at any await after its submission is aborted in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from launch.engine.request import SamplingParams
from launch.serving.api_server import ServerConfig, build_app
from launch.serving.engine_bridge import EngineBridge, RequestOutput
from launch.serving.metrics import ServerMetrics
from launch.serving.serving_completion import OpenAIServingCompletion
from launch.serving.serving_engine import EngineError
from launch.text.chat_template import load_chat_template
from launch.text.detokenizer import load_tokenizer
from tests.helpers.chat import build_chat_tokenizer

CHAT = {"messages": [{"role": "user", "content": "<7>"}]}


def _post(config: ServerConfig, path: str, body: dict) -> tuple[int, dict, int]:
    """(status, JSON answer, engine requests submitted)."""

    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        async with TestClient(TestServer(build_app(config, bridge))) as client:
            response = await client.post(path, json=body)
            new, _ = bridge.take(0)
            return response.status, await response.json(), len(new)

    return asyncio.run(go())


def _config(tmp_path, *, tokenizer: bool, template: bool) -> ServerConfig:
    build_chat_tokenizer().save_pretrained(str(tmp_path))
    if not template:
        (tmp_path / "chat_template.jinja").unlink()
    return ServerConfig(
        model_name="m",
        max_model_len=64,
        vocab_size=128,
        tokenizer=load_tokenizer(str(tmp_path)) if tokenizer else None,
        metrics=ServerMetrics(dp_size=1),
        chat_template=load_chat_template(str(tmp_path), None),
    )


@pytest.mark.parametrize(
    ("tokenizer", "template", "pattern"),
    [
        (False, True, "this checkpoint has no tokenizer"),
        (True, False, "no chat template .* --chat-template FILE"),
    ],
)
def test_chat_without_tokenizer_or_template_is_a_400(tmp_path, tokenizer, template, pattern):
    status, answer, num_submitted = _post(
        _config(tmp_path, tokenizer=tokenizer, template=template), "/v1/chat/completions", CHAT
    )
    assert status == 400 and num_submitted == 0
    assert answer["error"]["type"] == "invalid_request_error"
    assert re.search(pattern, answer["error"]["message"])


@contextlib.asynccontextmanager
async def _connected_client(server: TestServer, path: str, body: dict):
    """A client that POSTs ``body`` to ``path`` on a socket of its own and, on leaving the block,
    closes it unanswered: a real client's disconnect, on every aiohttp (on 3.9.0 cancelling the
    test client's request leaves its connection open). ``TestServer`` cancels a handler whose
    client is gone (``handler_cancellation``), as ``api_server`` does."""
    _, writer = await asyncio.open_connection(server.host, server.port)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    try:
        yield
    finally:
        writer.close()
        await writer.wait_closed()


async def _take_until(
    bridge: EngineBridge, enough: Callable[[list, list], bool], timeout_s: float = 10
) -> tuple[list, list]:
    """The new requests and aborted ids a stand-in engine (it never answers) takes until
    ``enough(new, aborted)`` or ``timeout_s`` passes."""
    new, aborted = [], []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not enough(new, aborted) and asyncio.get_running_loop().time() < deadline:
        more_new, more_aborted = bridge.take(0)
        new += more_new
        aborted += more_aborted
        await asyncio.sleep(0.01)
    return new, aborted


def test_requests_are_submitted_n_per_prompt_and_aborted_when_the_client_goes(tmp_path):
    config = _config(tmp_path, tokenizer=True, template=True)
    body = {"prompt": [[5, 6], [7]], "n": 2, "seed": 3, "top_p": 0.5, "logprobs": 2}

    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        async with TestServer(build_app(config, bridge)) as server:
            async with _connected_client(server, "/v1/completions", {**body, "max_tokens": 4}):
                new, _ = await _take_until(bridge, lambda new, _: len(new) == 4)
            _, aborts = await _take_until(bridge, lambda _, aborted: len(aborted) == 4)
            chat = {**CHAT, "max_tokens": 2}
            async with _connected_client(server, "/v1/chat/completions", chat):
                chat_new, _ = await _take_until(bridge, lambda new, _: len(new) == 1)
            return new, aborts, chat_new

    new, aborts, chat_new = asyncio.run(go())
    assert [r.prompt_token_ids for r in new] == [(5, 6), (5, 6), (7,), (7,)]
    assert [r.sampling_params.seed for r in new] == [3, 4, 3, 4]
    assert all(r.sampling_params.top_p == 0.5 and r.sampling_params.logprobs == 2 for r in new)
    assert sorted(aborts) == sorted(r.request_id for r in new)  # the client went: all aborted
    # the chat prompt: rendered by the template, encoded without adding special tokens
    expected = build_chat_tokenizer().apply_chat_template(
        CHAT["messages"], add_generation_prompt=True
    )["input_ids"]
    assert list(chat_new[0].prompt_token_ids) == expected


def test_a_client_gone_while_its_prompt_is_echoed_has_its_request_aborted(tmp_path, monkeypatch):
    # echoing a large prompt detokenizes it on the executor: an await after the submission
    echoing = asyncio.Event()

    async def slow_echo(self, request, prompt, prompt_ids):
        echoing.set()
        await asyncio.sleep(60)

    monkeypatch.setattr(OpenAIServingCompletion, "_echo_text", slow_echo)
    config = _config(tmp_path, tokenizer=True, template=True)
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "echo": True}

    async def go() -> tuple[list, list]:
        bridge = EngineBridge(asyncio.get_running_loop())
        async with TestServer(build_app(config, bridge)) as server:
            async with _connected_client(server, "/v1/completions", body):
                await asyncio.wait_for(echoing.wait(), 30)
            return await _take_until(bridge, lambda _, aborted: bool(aborted))

    submitted, aborted = asyncio.run(go())
    assert len(submitted) == 1 and aborted == [submitted[0].request_id]


def _one_request(config: ServerConfig):
    """(serving, choices, outputs): a completions handler on a fresh bridge of the running loop,
    with one request submitted (prompt [5, 6], 8 tokens) and no engine behind it."""
    serving = OpenAIServingCompletion(config, EngineBridge(asyncio.get_running_loop()))
    choices, outputs = serving.submit(
        [[5, 6]], n=1, params=lambda p, j: SamplingParams(max_tokens=8), stop=()
    )
    return serving, choices, outputs


def test_a_handler_cancelled_as_its_engine_output_arrives_ends(tmp_path):
    """aiohttp cancels a disconnected client's handler once. When that cancel lands in the event
    loop iteration in which an engine output reaches the handler's queue, the handler must still
    end (``asyncio.wait_for`` before Python 3.12 returned the output instead: the handler read on,
    and a non-streaming request ran to its ``max_tokens``)."""
    config = _config(tmp_path, tokenizer=True, template=True)

    async def go() -> tuple[asyncio.Task, list, list]:
        serving, choices, outputs = _one_request(config)
        received = []

        async def handler() -> None:
            async for delta in serving.deltas(choices, outputs):
                received.append(delta.token_ids)

        task = asyncio.create_task(handler())
        await asyncio.sleep(0.05)  # the handler waits for its next output
        outputs.put_nowait(RequestOutput(request_id=choices[0].request_id, new_token_ids=(9,)))
        task.cancel()  # the client's disconnect, in the same iteration
        await asyncio.wait((task,), timeout=2)
        task.cancel()  # a handler that read on is still waiting: end it
        await asyncio.gather(task, return_exceptions=True)
        return task, received, serving.bridge.take(0)[0]

    task, received, submitted = asyncio.run(go())
    assert len(submitted) == 1
    assert received == [], f"the cancelled handler read on: {received}"
    assert task.cancelled()


def test_a_request_with_no_engine_output_within_the_timeout_fails(tmp_path):
    config = dataclasses.replace(
        _config(tmp_path, tokenizer=True, template=True), output_timeout_s=0.2
    )

    async def go() -> None:
        serving, choices, outputs = _one_request(config)
        outputs.put_nowait(RequestOutput(request_id=choices[0].request_id, new_token_ids=(9,)))
        deltas = serving.deltas(choices, outputs)
        assert (await anext(deltas)).token_ids == (9,)
        with pytest.raises(EngineError, match="no output from the engine for 0.2 s"):
            await anext(deltas)

    asyncio.run(go())
