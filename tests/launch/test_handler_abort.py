"""A completion request whose client goes away is aborted in the engine from the moment it is
submitted: a handler cancelled at any await after the submission (here: while it echoes the
prompt, which a large prompt detokenizes off the event loop) still aborts its engine requests."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp.test_utils import TestClient, TestServer

from launch.serving.api_server import ServerConfig, build_app
from launch.serving.engine_bridge import EngineBridge
from launch.serving.metrics import ServerMetrics
from launch.serving.serving_completion import OpenAIServingCompletion


async def _submitted_then_aborted(bridge: EngineBridge, timeout_s: float) -> tuple[list, list]:
    """The ids a stand-in engine saw submitted and aborted (it never answers) until an abort
    arrives or ``timeout_s`` passes."""
    submitted, aborted = [], []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not aborted and loop.time() < deadline:
        new, aborts = bridge.take(0)
        submitted += [r.request_id for r in new]
        aborted += aborts
        await asyncio.sleep(0.01)
    return submitted, aborted


def test_a_client_gone_while_its_prompt_is_echoed_has_its_request_aborted(monkeypatch):
    echoing = asyncio.Event()

    async def slow_echo(self, request, prompt, prompt_ids):
        echoing.set()
        await asyncio.sleep(60)  # what a large prompt's detokenization on the executor costs

    monkeypatch.setattr(OpenAIServingCompletion, "_echo_text", slow_echo)
    config = ServerConfig(
        model_name="m",
        max_model_len=64,
        vocab_size=128,
        tokenizer=None,
        metrics=ServerMetrics(dp_size=1),
    )
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 8, "echo": True})

    async def go() -> tuple[list, list]:
        bridge = EngineBridge(asyncio.get_running_loop())
        server = TestServer(build_app(config, bridge), handler_cancellation=True)
        async with TestClient(server) as client:
            headers = {"Content-Type": "application/json"}
            post = asyncio.create_task(client.post("/v1/completions", data=body, headers=headers))
            await asyncio.wait_for(echoing.wait(), 30)
            post.cancel()  # the client goes away: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await post
            return await _submitted_then_aborted(bridge, timeout_s=10)

    submitted, aborted = asyncio.run(go())
    assert len(submitted) == 1 and aborted == submitted
