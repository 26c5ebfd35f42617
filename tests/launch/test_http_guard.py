"""Issue 28 cases 4, 5, 6, 8, 9, 10 on the real HTTP front end (``HTTPServerThread``) on a loopback
port, with a stand-in engine thread: slow and idle connections are closed by the read timeouts,
open connections are capped, parser-level errors are one log line, ``--api-key`` and JSON-only
bodies, the waiting-request bound, and ``/health`` failing while the engine loop is stuck. Every
socket has a timeout and every loop a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from launch.serving.api_server import HTTPServerThread, ServerConfig
from launch.serving.engine_bridge import RequestOutput
from launch.serving.http_guard import FirstRequestDeadline, GuardedTCPSite
from launch.serving.metrics import ServerMetrics

BODY = json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode()
JSON = {"Content-Type": "application/json"}


@dataclass
class Server:
    http: HTTPServerThread
    port: int
    engine_paused: threading.Event  # set: the stand-in engine stops taking (a stuck loop)
    hold: threading.Event  # set: requests are taken but never answered (they queue)


def _engine(server: Server, stop: threading.Event) -> None:
    bridge = server.http.bridge
    while not stop.is_set():
        if server.engine_paused.is_set():
            time.sleep(0.01)
            continue
        new, _ = bridge.take(0.01)
        for request in new if not server.hold.is_set() else ():
            bridge.deliver(
                RequestOutput(
                    request_id=request.request_id, new_token_ids=(7, 8), finish_reason="length"
                )
            )


@contextlib.contextmanager
def serve(**overrides) -> Iterator[Server]:
    config = ServerConfig(
        model_name="m",
        max_model_len=64,
        vocab_size=128,
        tokenizer=None,
        metrics=ServerMetrics(dp_size=1),
        output_timeout_s=20.0,
        **overrides,
    )
    http = HTTPServerThread(config, host="127.0.0.1", port=0)
    server = Server(http, http.start(), threading.Event(), threading.Event())
    stop = threading.Event()
    engine = threading.Thread(target=_engine, args=(server, stop), daemon=True)
    engine.start()
    try:
        yield server
    finally:
        stop.set()
        engine.join(timeout=5)
        http.stop(timeout_s=5)


def request(port: int, method: str, path: str, body=None, headers=None):
    """(status, headers, decoded JSON or raw bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        with contextlib.suppress(ValueError):
            data = json.loads(data)
        return response.status, response.headers, data
    finally:
        conn.close()


def raw_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.settimeout(20)
    return sock


def drip(sock: socket.socket, data: bytes, interval_s: float, limit_s: float) -> None:
    """Send ``data`` a byte every ``interval_s`` seconds, for at most ``limit_s`` seconds or until
    the server closes the connection."""
    start = time.monotonic()
    with contextlib.suppress(OSError):  # the server closes mid-drip
        for byte in data:
            sock.sendall(bytes([byte]))
            time.sleep(interval_s)
            if time.monotonic() - start > limit_s:
                break


def closed_within(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """(whether the server closed ``sock`` within ``timeout_s``, what it sent before)."""
    sock.settimeout(timeout_s)
    received = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return True, received
            received += chunk
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        return True, received
    return False, received


# case 5: read timeouts and the connection cap


def test_a_client_dripping_headers_is_closed_by_the_keep_alive_timeout():
    with serve(timeout_keep_alive_s=1.0) as server:
        sock = raw_socket(server.port)
        start = time.monotonic()
        drip(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaa", 0.2, 5)
        is_closed, _ = closed_within(sock, 5)
        assert is_closed and time.monotonic() - start < 5
        sock.close()
        assert request(server.port, "GET", "/health")[0] == 200


@contextlib.contextmanager
def deadline_only_server(timeout_s: float) -> Iterator[int]:
    """The port of an app behind ``GuardedTCPSite`` watched by ``FirstRequestDeadline(timeout_s)``
    alone (aiohttp's ``keepalive_timeout`` at its default, an hour), on an event loop in a thread;
    ``GET /slow`` answers "done" after 1.5 s."""

    async def slow(_request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.Response(text="done")

    deadline = FirstRequestDeadline(timeout_s)
    app = web.Application(middlewares=[deadline.middleware])
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    site = GuardedTCPSite(runner, "127.0.0.1", 0, max_connections=8, first_request=deadline)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield runner.addresses[0][1]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def test_the_first_request_deadline_alone_closes_silent_and_dripping_clients():
    """``FirstRequestDeadline`` on its own, as on the aiohttp releases (before 3.14.4) that arm
    ``keepalive_timeout`` only after a response: a connection that sends nothing, or drips its
    headers, is closed at the deadline; one whose request has started is not, however long its
    handler takes."""
    with deadline_only_server(0.5) as port:
        started = raw_socket(port)
        started.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        silent, dripping = raw_socket(port), raw_socket(port)
        start = time.monotonic()
        drip(dripping, b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, 0.1, 3)
        assert closed_within(dripping, 3)[0] and closed_within(silent, 3)[0]
        assert time.monotonic() - start < 3
        is_closed, answer = closed_within(started, 5)
        assert is_closed and answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"done"), answer
        for sock in (started, silent, dripping):
            sock.close()


def test_a_stalled_body_gets_408_and_idle_half_sent_requests_are_closed():
    with serve(timeout_keep_alive_s=1.0, body_read_timeout_s=1.0) as server:
        stalled = raw_socket(server.port)
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b'application/json\r\nContent-Length: 100\r\n\r\n{"prompt"'
        )
        idle = [raw_socket(server.port) for _ in range(50)]  # half-sent headers, then silence
        for sock in idle:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost:")
        start = time.monotonic()
        is_closed, answer = closed_within(stalled, 5)
        assert is_closed and answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within 1 s" in answer
        assert all(closed_within(sock, 5)[0] for sock in idle)
        assert time.monotonic() - start < 6
        for sock in [stalled, *idle]:
            sock.close()
        assert request(server.port, "POST", "/v1/completions", BODY, JSON)[0] == 200


def test_connections_past_the_cap_get_503_and_are_closed():
    with serve(max_connections=4, timeout_keep_alive_s=10.0) as server:
        held = [raw_socket(server.port) for _ in range(4)]
        time.sleep(0.2)  # the server registers them
        extra = raw_socket(server.port)
        is_closed, answer = closed_within(extra, 5)
        assert is_closed and answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"Retry-After: 1" in answer and b"open connections" in answer
        for sock in [*held, extra]:
            sock.close()
        deadline = time.monotonic() + 5
        while request(server.port, "GET", "/health")[0] != 200:  # the held ones are gone
            assert time.monotonic() < deadline
            time.sleep(0.1)


# case 8: parser-level errors are one log line


@pytest.mark.parametrize(
    "data",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ],
    ids=["negative_content_length", "70kb_header", "http2_preface"],
)
def test_parser_level_400s_are_one_log_line(caplog, data):
    with serve() as server, caplog.at_level(logging.INFO):
        sock = raw_socket(server.port)
        sock.sendall(data)
        is_closed, answer = closed_within(sock, 5)
        sock.close()
        assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), answer[:200]
        time.sleep(0.1)  # the log record is written after the answer
    records = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert all(r.exc_info is None or r.exc_info[0] is None for r in records), records
    assert all("\n" not in r.getMessage() for r in records)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert is_closed


# case 9: --api-key and JSON-only bodies


def test_api_key_is_required_on_v1_only():
    with serve(api_keys=("sekret",)) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            status, head, body = request(
                server.port, "POST", "/v1/completions", BODY, {**JSON, **headers}
            )
            assert status == 401 and head["WWW-Authenticate"] == "Bearer", body
            assert body["error"]["code"] == 401 and "API key" in body["error"]["message"]
        assert request(server.port, "GET", "/v1/models")[0] == 401
        assert request(server.port, "GET", "/v1/nope")[0] == 401
        auth = {"Authorization": "Bearer sekret"}
        assert request(server.port, "POST", "/v1/completions", BODY, {**JSON, **auth})[0] == 200
        assert request(server.port, "GET", "/v1/models", headers=auth)[0] == 200
        assert request(server.port, "GET", "/health")[0] == 200
        assert request(server.port, "GET", "/metrics")[0] == 200


def test_vllm_api_key_environment_variable(monkeypatch):
    from launch.serve import build_parser
    from launch.serving.frontend_args import frontend_args_from_namespace

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert frontend_args_from_namespace(build_parser().parse_args([])).api_keys == ("from-env",)
    ns = build_parser().parse_args(["--api-key", "a", "b"])
    assert frontend_args_from_namespace(ns).api_keys == ("a", "b")
    monkeypatch.delenv("VLLM_API_KEY")
    assert frontend_args_from_namespace(build_parser().parse_args([])).api_keys == ()


def _raw_answer(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """(status, JSON body) of one request sent as raw bytes (headers not UTF-8)."""
    sock = raw_socket(port)
    sock.sendall(head + b"Connection: close\r\n\r\n" + body)
    is_closed, answer = closed_within(sock, 5)
    sock.close()
    assert is_closed, answer[:200]
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_headers_that_are_not_utf8_get_json_4xx_and_no_traceback(caplog):
    """Issue 35 case 1: ``Authorization: Bearer \\xe9`` was a plain-text 500 and a
    UnicodeEncodeError traceback per request."""
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(BODY)
    with serve(api_keys=("K",)) as server, caplog.at_level(logging.INFO):
        for head in (b"Authorization: Bearer \xe9\r\n", b"Authorization: \xff K\r\n"):
            status, body = _raw_answer(
                server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + head
            )
            assert status == 401 and body["error"]["code"] == 401, body
            assert "the Authorization header is not UTF-8 (byte 0x" in body["error"]["message"]
        for content_type in (b"application/json; charset=\xe9", b"application/\xe9+json"):
            head = post + b"Authorization: Bearer K\r\nContent-Type: " + content_type + b"\r\n"
            status, body = _raw_answer(server.port, head, BODY)
            assert status == 400, body
            assert "the Content-Type header is not UTF-8 (byte 0xe9" in body["error"]["message"]
        auth = {"Authorization": "Bearer K"}
        assert request(server.port, "POST", "/v1/completions", BODY, {**JSON, **auth})[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_content_types_get_415(content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    with serve() as server:
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, _, body = request(server.port, "POST", path, BODY, headers)
            assert status == 415 and "Content-Type: application/json" in body["error"]["message"]
        charset = {"Content-Type": "application/json; charset=utf-8"}
        assert request(server.port, "POST", "/v1/completions", BODY, charset)[0] == 200


# case 10 and case 4: the waiting-request bound; /health while the engine loop is stuck


def _send_without_reading(port: int, body: bytes) -> socket.socket:
    sock = raw_socket(port)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def test_a_full_queue_answers_503_with_retry_after():
    with serve(max_queued_requests=3) as server:
        server.hold.set()
        queued = [_send_without_reading(server.port, BODY) for _ in range(3)]
        deadline = time.monotonic() + 5
        while server.http.bridge.num_queued < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, head, body = request(server.port, "POST", "/v1/completions", BODY, JSON)
        assert status == 503 and head["Retry-After"] == "1", body
        assert "--max-queued-requests 3" in body["error"]["message"]
        assert body["error"]["type"] == "service_unavailable"
        assert request(server.port, "GET", "/health")[0] == 200  # busy, not broken
        for sock in queued:  # the client goes: its request is aborted and leaves the queue
            sock.close()
        server.hold.clear()
        deadline = time.monotonic() + 5
        while request(server.port, "POST", "/v1/completions", BODY, JSON)[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_health_fails_while_the_engine_loop_is_stuck_and_recovers():
    with serve(engine_stall_timeout_s=0.5) as server:
        assert request(server.port, "GET", "/health")[0] == 200
        server.engine_paused.set()
        start = time.monotonic()
        while (answer := request(server.port, "GET", "/health"))[0] == 200:
            assert time.monotonic() - start < 5
            time.sleep(0.05)
        status, head, body = answer
        assert status == 503 and head["Retry-After"] == "1"
        assert "has not completed a step or heartbeat" in body["error"]["message"], body
        assert request(server.port, "POST", "/v1/completions", BODY, JSON)[0] == 503
        server.engine_paused.clear()
        deadline = time.monotonic() + 5
        while request(server.port, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# case 6: large inputs are (de)tokenized off the event loop, with the same result


def test_large_inputs_take_the_gil_releasing_path_with_the_same_ids(tmp_path):
    from launch.text.detokenizer import LARGE_INPUT, load_tokenizer
    from tests.helpers.chat import build_chat_tokenizer

    build_chat_tokenizer().save_pretrained(str(tmp_path))
    tokenizer = load_tokenizer(str(tmp_path))
    text = " ".join(f"<{i % 128}>" for i in range(3 * LARGE_INPUT))
    ids = tokenizer.encode(text)
    assert len(text) >= LARGE_INPUT and ids == tokenizer._tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == tokenizer._tokenizer.decode(ids, skip_special_tokens=True)


def test_health_stays_fast_while_8_large_prompts_are_tokenized():
    """The measurement of ``launch.benchmarks.health_latency`` at a smaller size (8 x 256 KB);
    the bound is loose (a shared 2-core machine), the benchmark prints the numbers."""
    from launch.benchmarks.health_latency import measure

    result = measure(8, 256_000)
    assert sorted(result["statuses"]) == [200] * 8
    assert max(result["loaded"]) < 0.5, result["loaded"]


# case 10's other points: SIGINT is named; /v1/models shows the name given


def test_sigint_is_named_as_the_stop_reason():
    import os
    import signal

    from launch.serve import _install_stop_handlers

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = _install_stop_handlers()
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not stop.is_set():  # the handler runs in the main thread, between bytecodes
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert stop.reason == "SIGINT"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--model", "ckpt/tiny"], "ckpt/tiny"),  # the path as given, never made absolute
        (["--model", "/abs/tiny", "--served-model-name", "tiny"], "tiny"),
    ],
)
def test_models_name_is_the_served_name_or_the_path_as_given(argv, name):
    from launch.serve import _model_name, build_parser

    assert _model_name(build_parser().parse_args(argv)) == name


# issue 55: large bodies are decoded in the JSON decoder's worker processes

PADDED = BODY + b" " * (70 * 1024)  # a 70 KiB body that decodes at once: whitespace after BODY


def _nested(num_bytes: int) -> bytes:
    """A completion body of about ``num_bytes`` whose prompt holds lists nested 500 deep, each
    level within the limit: slow to decode and to check, and refused (400) in the end."""
    unit = "[" * 500 + "]" * 500
    return ('{"prompt": [' + ",".join([unit] * (num_bytes // (len(unit) + 1))) + "]}").encode()


def _decoder(server: Server):
    from launch.serving.http_errors import JSON_DECODER

    return server.http._runner.app[JSON_DECODER]


def _post(port: int, body: bytes, answers: dict, name: str) -> None:
    """POST ``body``; ``answers[name]`` = (status, headers, body, when it came, monotonic s)."""
    status, head, data = request(port, "POST", "/v1/completions", body, JSON)
    answers[name] = (status, head, data, time.monotonic())


def test_stalled_decoder_workers_answer_503_at_the_deadline_and_are_replaced():
    with serve(body_decode_timeout_s=1.0) as server:
        assert request(server.port, "POST", "/v1/completions", PADDED, JSON)[0] == 200
        stalled = _decoder(server).worker_pids
        assert len(stalled) == 2
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        answers: dict = {}
        start = time.monotonic()
        try:  # one body for each stalled worker
            posts = [
                threading.Thread(target=_post, args=(server.port, PADDED, answers, i))
                for i in range(2)
            ]
            for post in posts:
                post.start()
            for post in posts:
                post.join(timeout=30)
        finally:
            for pid in stalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        for status, head, body, answered in answers.values():
            assert status == 503 and head["Retry-After"] == "1", body
            assert "JSON decoder gave no answer within 1 s" in body["error"]["message"], body
            assert answered - start < 6
        assert len(answers) == 2
        # the next body: decoded by a new worker
        assert request(server.port, "POST", "/v1/completions", PADDED, JSON)[0] == 200
        assert not set(stalled) & set(_decoder(server).worker_pids)


def test_workers_killed_twice_are_the_servers_fault_never_a_400(monkeypatch):
    from tests.launch.test_json_decoding import _dying_workers

    _dying_workers(monkeypatch, signal.SIGKILL)
    with serve() as server:
        status, head, body = request(server.port, "POST", "/v1/completions", PADDED, JSON)
    assert status == 503 and head["Retry-After"] == "1", body
    assert "died while decoding this request body" in body["error"]["message"], body


def test_a_70_kib_body_is_not_held_up_by_another_clients_nested_body():
    """The fault probe's case, smaller: while another client's large body of brackets nested 500
    deep (slow to decode, and seconds to check) is handled, a 70 KiB body is answered first."""
    with serve() as server:
        assert request(server.port, "POST", "/v1/completions", PADDED, JSON)[0] == 200
        answers: dict = {}
        nested = threading.Thread(
            target=_post, args=(server.port, _nested(260 * 1024), answers, "nested")
        )
        nested.start()
        time.sleep(0.3)  # the nested body is being decoded
        _post(server.port, PADDED, answers, "small")
        nested.join(timeout=60)
    small, nested = answers["small"], answers["nested"]
    assert small[0] == 200 and nested[0] == 400, answers
    assert small[3] < nested[3]
