"""The HTTP surface answers only in JSON (OpenAI error objects for errors) and survives every input.

The real aiohttp server (``HTTPServerThread``, middleware, handlers, bridge) runs in this process on
a loopback port, with a stand-in engine thread that answers each request with ``max_tokens`` tokens
(``prompt[-1] + i``), so hundreds of requests take seconds. The engine's own failure isolation is
tested in ``test_failure_isolation.py`` and end to end in ``test_serve_faults.py``.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launch.serving.api_server import HTTPServerThread, ServerConfig
from launch.serving.engine_bridge import RequestOutput
from launch.serving.metrics import ServerMetrics
from launch.text.text_bound import ASSUMED_BYTES_PER_TOKEN, BytesPerToken

VOCAB_SIZE = 128
MAX_MODEL_LEN = 64
BAD_TOKEN = 99  # the stand-in tokenizer cannot decode it


class _Tokenizer:
    """Token i is the word ``<i>``; decoding BAD_TOKEN raises (a detokenizer bug, say)."""

    bytes_per_token = BytesPerToken(num_bytes=ASSUMED_BYTES_PER_TOKEN, is_derived=False)

    def encode(self, text: str) -> list[int]:
        return [
            int(word.strip("<>")) % VOCAB_SIZE
            for word in text.split()
            if word.strip("<>").isdigit()
        ]

    def decode(self, token_ids: list[int]) -> str:
        if BAD_TOKEN in token_ids:
            raise RuntimeError(f"cannot decode token {BAD_TOKEN}")
        return " ".join(f"<{t}>" for t in token_ids)


def _engine(http: HTTPServerThread, stop: threading.Event) -> None:
    """Answer every request at once: tokens prompt[-1] + i, then 'length'."""
    while not stop.is_set():
        new, _aborts = http.bridge.take(0.02)
        for request in new:
            first = request.prompt_token_ids[-1]
            n = request.sampling_params.max_tokens
            tokens = tuple((first + i) % VOCAB_SIZE for i in range(n))
            http.bridge.deliver(
                RequestOutput(
                    request_id=request.request_id, new_token_ids=tokens, finish_reason="length"
                )
            )


def _start(tokenizer) -> Iterator[str]:
    config = ServerConfig(
        model_name="m",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB_SIZE,
        tokenizer=tokenizer,
        metrics=ServerMetrics(dp_size=1),
        output_timeout_s=10.0,
    )
    http = HTTPServerThread(config, host="127.0.0.1", port=0)
    port = http.start()
    stop = threading.Event()
    engine = threading.Thread(target=_engine, args=(http, stop), daemon=True)
    engine.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        engine.join(timeout=5)
        http.stop(timeout_s=5)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from _start(tokenizer=None)


@pytest.fixture(scope="module")
def text_server() -> Iterator[str]:
    yield from _start(tokenizer=_Tokenizer())


def request(
    address: str,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str = "application/json",
) -> tuple[int, str, bytes]:
    """(status, Content-Type, body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        headers = {"Content-Type": content_type} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def assert_error(answer: tuple[int, str, bytes], status: int, pattern: str = "") -> dict:
    code, content_type, body = answer
    assert code == status, body[:300]
    assert content_type.startswith("application/json"), content_type
    error = json.loads(body)["error"]
    assert error["code"] == status and isinstance(error["message"], str), error
    assert pattern in error["message"], error
    return error


def post(address: str, body, **kwargs):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(address, "POST", "/v1/completions", data, **kwargs)


def test_aiohttp_errors_are_openai_error_objects(server):
    assert_error(request(server, "GET", "/nope"), 404, "no such route")
    assert_error(request(server, "GET", "/" + "a" * 20000), 404, "no such route")
    assert_error(request(server, "DELETE", "/v1/completions"), 405, "allowed: POST")
    assert_error(request(server, "POST", "/health", b"{}"), 405)
    assert_error(post(server, b"x" * (1 << 21)), 413, "too large")


@pytest.mark.parametrize(
    ("body", "content_type", "pattern"),
    [
        (b'{"prompt": [5]}', "application/json; charset=nonexistent", "unknown charset"),
        (b'{"prompt": "\xff\xfe"}', "application/json", "not valid utf-8"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "nested too deeply"),
        (b'{"prompt": [5], "max_tokens": ' + b"9" * 5000 + b"}", "application/json", "4300"),
        (b'{"prompt": [5], "temperature": NaN}', "application/json", "'temperature' must be"),
        (b'{"prompt": [[[5]]]}', "application/json", "got [[[5]]]"),
        (b'{"prompt": [5], "stop": ["x"]}', "application/json", "need the checkpoint's tokenizer"),
        (b'{"prompt": [5], "seed": 18446744073709551616}', "application/json", "'seed' must be"),
    ],
    # short ids: the bodies themselves would name the test with up to 200,000 characters
    ids=[
        "unknown_charset",
        "invalid_utf8",
        "nested_100k_deep",
        "int_5000_digits",
        "nan_temperature",
        "prompt_nested_3_deep",
        "stop_without_tokenizer",
        "seed_past_uint64",
    ],
)
def test_hostile_bodies_get_400(server, body, content_type, pattern):
    assert_error(post(server, body, content_type=content_type), 400, pattern)


def test_tiny_temperature_and_the_largest_seed_are_served(server):
    body = {"prompt": [5], "max_tokens": 3, "temperature": 1e-300, "seed": 2**63 - 1}
    code, _, answer = post(server, {**body, "return_token_ids": True})
    assert code == 200 and json.loads(answer)["choices"][0]["token_ids"] == [5, 6, 7]


def test_a_request_that_fails_to_detokenize_fails_alone(text_server):
    # whole response: a 500 error object; streamed: an error event
    error = assert_error(post(text_server, {"prompt": [BAD_TOKEN], "max_tokens": 2}), 500)
    assert error["message"] == f"detokenizing failed: RuntimeError: cannot decode token {BAD_TOKEN}"
    code, _, body = post(text_server, {"prompt": [BAD_TOKEN], "max_tokens": 2, "stream": True})
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert code == 200 and events[-1] == "[DONE]"
    assert "detokenizing failed: RuntimeError" in json.loads(events[-2])["error"]["message"]
    code, _, body = post(text_server, {"prompt": "<5>", "max_tokens": 2, "stop": ["<7>"]})
    assert code == 200 and json.loads(body)["choices"][0]["text"] == "<5> <6>"


# Bodies: arbitrary JSON, and objects mixing the schema's fields with arbitrary values.
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
_FIELDS = (
    "prompt",
    "max_tokens",
    "temperature",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "return_token_ids",
    "model",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "suffix",
)
_token_ids = st.lists(st.integers(min_value=-5, max_value=VOCAB_SIZE + 5), max_size=8)
_value = _json | _token_ids | st.integers(min_value=-3, max_value=2 * MAX_MODEL_LEN)
_bodies = st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=8) | _json
_raw = st.binary(max_size=64)


@settings(
    max_examples=300,
    deadline=5000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_bodies | _raw, charset=st.sampled_from(["", "; charset=utf-8", "; charset=latin-1"]))
def test_fuzz_no_body_gets_a_5xx_or_a_non_json_answer(server, body, charset):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, content_type, answer = post(server, data, content_type="application/json" + charset)
    assert code < 500, answer[:300]
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in answer.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert content_type.startswith("application/json"), content_type
        decoded = json.loads(answer)
        if code >= 400:
            assert decoded["error"]["code"] == code
        else:
            assert decoded["object"] == "text_completion"


def test_the_server_still_answers_after_the_fuzz(server):
    code, _, body = post(server, {"prompt": [9], "max_tokens": 2, "return_token_ids": True})
    assert code == 200 and json.loads(body)["choices"][0]["token_ids"] == [9, 10]
    assert request(server, "GET", "/health")[0] == 200
