"""Issue 28 case 1: text that is not valid Unicode (a lone UTF-16 surrogate, which Python's json
accepts) is refused as a 400 naming the field, where requests are parsed, before the tokenizer
(HF tokenizers raises TypeError on it) or anything else sees it; the server keeps serving."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from launch.serving.api_server import ServerConfig, build_app
from launch.serving.chat_template import load_chat_template
from launch.serving.detokenizer import load_tokenizer
from launch.serving.engine_bridge import EngineBridge, RequestOutput
from launch.serving.metrics import ServerMetrics
from launch.serving.openai_protocol import ProtocolError, parse_completion_request
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
