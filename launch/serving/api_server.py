"""The OpenAI-compatible HTTP front end (aiohttp), run by rank 0 on a thread of its own.

Routes: ``POST /v1/completions`` (whole response, or server-sent events ending in
``data: [DONE]`` with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
Requests go to the engine loop through an ``EngineBridge``; bad requests are answered 400 with an
OpenAI error object, requests during shutdown 503; every other error answer is an OpenAI error
object too (``launch.serving.http_errors``). A failure of one request (its sampling in the engine,
its detokenization here) ends that request alone with an error; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from launch.serving.detokenizer import IncrementalText
from launch.serving.engine_bridge import EngineBridge, RequestOutput, ServerShuttingDown
from launch.serving.http_errors import (
    MAX_LINE_BYTES,
    json_error,
    openai_error_middleware,
    read_json_body,
)
from launch.serving.metrics import ServerMetrics
from launch.serving.openai_protocol import (
    CompletionRequest,
    ProtocolError,
    check_prompt_ids,
    completion_body,
    error_body,
    parse_completion_request,
)

# A request with no output for this long is failed (504): the engine loop is stuck or gone.
OUTPUT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None  # launch.tokenizer.Tokenizer, or None: token-id prompts only
    metrics: ServerMetrics
    kv_capacity_tokens: int | None = None  # KV cache slots per DP rank: the most one request holds
    output_timeout_s: float = OUTPUT_TIMEOUT_S


_error = json_error
logger = logging.getLogger("launch.serving")


def _error_status(error: Exception) -> int:
    """HTTP status of a failed request's output: 503 if the server shut down, else 500."""
    return 503 if isinstance(error, ServerShuttingDown) else 500


class CompletionsHandler:
    """``POST /v1/completions`` for one ``EngineBridge``."""

    def __init__(self, config: ServerConfig, bridge: EngineBridge) -> None:
        self.config = config
        self.bridge = bridge
        self.created = int(time.time())

    async def __call__(self, http_request: web.Request) -> web.StreamResponse:
        config = self.config
        try:
            body = await read_json_body(http_request)
            request = parse_completion_request(body, model_name=config.model_name)
            if request.stop and config.tokenizer is None:
                raise ProtocolError(
                    "'stop' strings need the checkpoint's tokenizer (tokenizer.json) and this "
                    "model has none; use 'stop_token_ids'",
                    param="stop",
                )
            prompt_ids = self._prompt_ids(request)
            check_prompt_ids(
                prompt_ids,
                max_tokens=request.max_tokens,
                vocab_size=config.vocab_size,
                max_model_len=config.max_model_len,
            )
            num_tokens = len(prompt_ids) + request.max_tokens
            if config.kv_capacity_tokens is not None and num_tokens > config.kv_capacity_tokens:
                raise ProtocolError(
                    f"prompt + max_tokens = {num_tokens} tokens exceed the KV cache of a DP rank "
                    f"({config.kv_capacity_tokens} tokens)",
                    param="max_tokens",
                )
            request_id, outputs = self.bridge.submit(prompt_ids, request.sampling_params())
        except ProtocolError as e:
            config.metrics.requests_rejected.inc()
            return _error(str(e), e.status, e.param)
        except ServerShuttingDown as e:
            config.metrics.requests_rejected.inc()
            return _error(str(e), 503)
        text = IncrementalText(config.tokenizer, request.stop)
        finished = False
        try:
            if request.stream:
                response = await self._stream(http_request, request, request_id, outputs, text)
            else:
                response = await self._whole(request, request_id, len(prompt_ids), outputs, text)
            finished = True
            return response
        finally:
            if not finished or text.stopped:
                self.bridge.abort(request_id)  # client gone, error, or a stop string matched

    def _prompt_ids(self, request: CompletionRequest) -> list[int]:
        tokenizer = self.config.tokenizer
        if isinstance(request.prompt, list):
            return request.prompt
        if tokenizer is None:
            raise ProtocolError(
                "this checkpoint has no tokenizer: send the prompt as a list of token ids",
                param="prompt",
            )
        return tokenizer.encode(request.prompt)

    async def _next(self, outputs: asyncio.Queue[RequestOutput], request_id: int) -> RequestOutput:
        try:  # blocking wait for the engine loop, with a timeout
            return await asyncio.wait_for(outputs.get(), timeout=self.config.output_timeout_s)
        except asyncio.TimeoutError:
            return RequestOutput(
                request_id=request_id,
                error=TimeoutError(
                    f"no output from the engine for {self.config.output_timeout_s:g} s"
                ),
            )

    async def _whole(self, request, request_id, num_prompt, outputs, text) -> web.Response:
        token_ids: list[int] = []
        while True:
            output = await self._next(outputs, request_id)
            if output.error is not None:
                return _error(str(output.error), _error_status(output.error))
            token_ids += output.new_token_ids
            text.add(output.new_token_ids, is_last=output.is_last)
            if output.is_last or text.stopped:
                break
        usage = {
            "prompt_tokens": num_prompt,
            "completion_tokens": len(token_ids),
            "total_tokens": num_prompt + len(token_ids),
        }
        body = completion_body(
            request_id=f"cmpl-{request_id}",
            model=self.config.model_name,
            text=text.text,
            token_ids=token_ids if request.return_token_ids else None,
            finish_reason="stop" if text.stopped else output.finish_reason,
            usage=usage,
            created=self.created,
        )
        return web.json_response(body)

    async def _stream(self, http_request, request, request_id, outputs, text) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http_request)
        while True:
            output = await self._next(outputs, request_id)
            if output.error is not None:
                status = _error_status(output.error)
                await _send(response, error_body(str(output.error), status=status))
                break
            try:
                delta = text.add(output.new_token_ids, is_last=output.is_last)
            except Exception as e:  # noqa: BLE001 - this request's detokenizing fails it alone
                logger.exception("detokenizing request %d failed", request_id)
                message = f"detokenizing failed: {type(e).__name__}: {e}"
                await _send(response, error_body(message, status=500))
                break
            finish_reason = "stop" if text.stopped else output.finish_reason
            chunk = completion_body(
                request_id=f"cmpl-{request_id}",
                model=self.config.model_name,
                text=delta,
                token_ids=list(output.new_token_ids) if request.return_token_ids else None,
                finish_reason=finish_reason,
                usage=None,
                created=self.created,
            )
            await _send(response, chunk)
            if finish_reason is not None:
                break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _send(response: web.StreamResponse, body: dict) -> None:
    await response.write(f"data: {json.dumps(body)}\n\n".encode())


def build_app(config: ServerConfig, bridge: EngineBridge) -> web.Application:
    async def health(_request: web.Request) -> web.Response:
        if not bridge.is_accepting:
            return _error("the server is shutting down", 503)
        return web.json_response({"status": "ok"})

    async def models(_request: web.Request) -> web.Response:
        model = {
            "id": config.model_name,
            "object": "model",
            "created": handler.created,
            "owned_by": "moe-dbo",
            "max_model_len": config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def metrics(_request: web.Request) -> web.Response:
        response = web.Response(body=config.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    handler = CompletionsHandler(config, bridge)
    app = web.Application(middlewares=[openai_error_middleware])
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


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
            self._runner = web.AppRunner(
                app,
                shutdown_timeout=5.0,
                access_log=None,
                max_line_size=MAX_LINE_BYTES,
                max_field_size=MAX_LINE_BYTES,
            )
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
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
