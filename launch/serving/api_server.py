"""The OpenAI-compatible HTTP front end (aiohttp), run by rank 0 on a thread of its own: the
completions, chat, models, health, metrics and profiler routes, which hand requests to the engine
loop through an ``EngineBridge``. Routes and answers: docs/serving.md#api."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from launch.serving.engine_bridge import EngineBridge, ServerShuttingDown
from launch.serving.http_errors import (
    JSON_DECODER,
    LARGE_BODY_LOCK,
    MAX_LINE_BYTES,
    openai_error_middleware,
)
from launch.serving.http_guard import (
    FIRST_REQUEST_DEADLINE,
    RETRY_AFTER_S,
    FirstRequestDeadline,
    GuardedTCPSite,
    OneLineServerLogger,
    api_key_middleware,
    wait_within,
)
from launch.serving.json_decoding import DECODE_TIMEOUT_S, JsonDecoder
from launch.serving.metrics import ServerMetrics
from launch.serving.openai_protocol import error_body
from launch.serving.serving_chat import OpenAIServingChat
from launch.serving.serving_completion import OpenAIServingCompletion
from launch.serving.serving_engine import engine_unavailable_reason

# A request with no output for this long is failed (504): the engine loop is stuck or gone.
OUTPUT_TIMEOUT_S = 600.0
LINGERING_TIME_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None  # launch.tokenizer.Tokenizer, or None: token-id prompts only
    metrics: ServerMetrics
    kv_capacity_tokens: int | None = None  # KV cache slots per DP rank: the most one request holds
    chat_template: object | None = None  # launch.text.chat_template.ChatTemplate, or None
    output_timeout_s: float = OUTPUT_TIMEOUT_S
    api_keys: tuple[str, ...] = ()  # empty: no authentication (--api-key, $VLLM_API_KEY)
    timeout_keep_alive_s: float = 5.0  # to send a request's headers, or idle between requests
    body_read_timeout_s: float = 30.0  # to send a request's body (408 after)
    body_decode_timeout_s: float = DECODE_TIMEOUT_S  # to decode a large body (503 after)
    max_connections: int = 512  # open connections (503 and closed past it)
    max_queued_requests: int | None = None  # waiting engine requests (503 past it); None: no bound
    engine_stall_timeout_s: float = 30.0  # /health 503 once the engine loop is stuck this long
    profiling: bool = False  # --profiler-config given: the /start_profile and /stop_profile routes


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, param=param), status=status)


def build_app(config: ServerConfig, bridge: EngineBridge) -> web.Application:
    async def health(_request: web.Request) -> web.Response:
        if not bridge.is_accepting:
            return _error("the server is shutting down", 503)
        reason = engine_unavailable_reason(bridge, config.engine_stall_timeout_s)
        if reason is not None:
            response = _error(reason, 503)
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        return web.json_response({"status": "ok"})

    async def models(_request: web.Request) -> web.Response:
        model = {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "moe-dbo",
            "max_model_len": config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def metrics(_request: web.Request) -> web.Response:
        response = web.Response(body=config.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    created = int(time.time())
    # the first-request deadline's mark first (it cannot fail); the error middleware next, so
    # that anything unexpected (the key check included) answers a JSON 500; the key check runs
    # before the router's handler, so no route, not even a 404, answers without the key
    first_request = FirstRequestDeadline(config.timeout_keep_alive_s)
    middlewares = [first_request.middleware, openai_error_middleware]
    if config.api_keys:
        middlewares.append(api_key_middleware(config.api_keys))
    app = web.Application(middlewares=middlewares)
    app[FIRST_REQUEST_DEADLINE] = first_request
    app[LARGE_BODY_LOCK] = asyncio.Lock()  # the largest bodies are checked one at a time
    # and decoded in worker processes, each within its deadline
    app[JSON_DECODER] = decoder = JsonDecoder(timeout_s=config.body_decode_timeout_s)

    async def close_decoder(_app: web.Application) -> None:
        decoder.close()

    app.on_cleanup.append(close_decoder)
    app.router.add_post("/v1/completions", OpenAIServingCompletion(config, bridge).__call__)
    app.router.add_post("/v1/chat/completions", OpenAIServingChat(config, bridge).__call__)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if config.profiling:
        for action in ("start", "stop"):
            app.router.add_post(f"/{action}_profile", profile_handler(action, config, bridge))
    return app


def profile_handler(action: str, config: ServerConfig, bridge: EngineBridge):
    """``POST /<action>_profile``: every rank's profiler started or stopped (``EngineBridge.
    profile``); 200 with an empty body once every rank applied it (a stop has written every
    rank's trace), 503 during shutdown, 504 after ``output_timeout_s``, 500 naming the first
    rank that failed."""

    async def handler(_request: web.Request) -> web.Response:
        try:  # bounded wait for every rank (a stop writes every rank's trace)
            await wait_within(bridge.profile(action), config.output_timeout_s)
        except ServerShuttingDown as e:
            return _error(str(e), 503)
        except asyncio.TimeoutError:
            return _error(f"{action}_profile: no answer in {config.output_timeout_s:g} s", 504)
        except Exception as e:  # noqa: BLE001 - the order failed on a rank (e.g. writing the trace)
            return _error(f"{action}_profile failed: {type(e).__name__}: {e}", 500)
        return web.Response(status=200)

    return handler


def _make_runner(app: web.Application, config: ServerConfig) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, whose ``finally``
    # aborts its engine requests (aiohttp >= 3.9 leaves handlers running). keepalive_timeout is
    # armed when a connection opens and disarmed only by a complete request: it closes a client
    # that drips its headers, or sends none, as well as one idle between requests.
    return web.AppRunner(
        app,
        shutdown_timeout=5.0,
        access_log=None,
        handler_cancellation=True,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_LINE_BYTES,
        keepalive_timeout=config.timeout_keep_alive_s,
        # after an answer sent before the body was read (401, 415, 408), unread body bytes are
        # drained for at most this long, then the connection closes (aiohttp's default: 10 s)
        lingering_time=LINGERING_TIME_S,
        logger=OneLineServerLogger(logging.getLogger("aiohttp.server"), {}),
    )


class HTTPServerThread:
    """Runs the aiohttp app on its own event loop in a daemon thread (rank 0)."""

    def __init__(self, config: ServerConfig, *, host: str, port: int) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.bridge: EngineBridge | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> int:
        """Start serving; the bound port. Raises OSError if the address cannot be bound."""
        self._thread.start()
        if not self._ready.wait(timeout_s):  # blocking wait for the bind, with a timeout
            raise TimeoutError(f"the HTTP server did not start within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self.bridge = EngineBridge(loop)
            app = build_app(self.config, self.bridge)
            self._runner = _make_runner(app, self.config)
            loop.run_until_complete(self._runner.setup())
            site = GuardedTCPSite(
                self._runner,
                self.host,
                self.port,
                max_connections=self.config.max_connections,
                first_request=app[FIRST_REQUEST_DEADLINE],
            )
            loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as e:  # noqa: BLE001 - handed to start() in the main thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let open responses finish (up to ``timeout_s``), close the listener, end the thread."""
        if self._loop is None or self._runner is None or not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        with contextlib.suppress(Exception):  # best effort: the process exits next
            future.result(timeout=timeout_s)  # blocking wait, with a timeout
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)
