"""What keeps the HTTP front end honest with slow, odd and unauthenticated clients: the connection
cap (``GuardedTCPSite``), ``FirstRequestDeadline``, ``OneLineServerLogger``,
``api_key_middleware``, ``require_json``, ``wait_within`` and ``header_text``. What each guards
against, and why aiohttp's own settings do not: docs/serving.md#http-guards."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from launch.serving.openai_protocol import ProtocolError, error_body

T = TypeVar("T")

logger = logging.getLogger("launch.serving")

# Retry-After (seconds) on a 503 for a full server: clients back off, then try again.
RETRY_AFTER_S = 1


class OneLineServerLogger(logging.LoggerAdapter):
    """aiohttp's ``logger=``: parser-level errors (``HttpProcessingError``) become one warning
    line naming the error, cut to 300 characters; anything else is logged as aiohttp logs it."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(error, HttpProcessingError):
            text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            self.warning(msg % args + ": " + text)  # no traceback: the client's fault
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _full_response(max_connections: int) -> bytes:
    body = json.dumps(
        error_body(f"the server has {max_connections} open connections (its limit)", status=503)
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _RefuseConnection(asyncio.Protocol):
    """A connection past the cap: answer 503 and close (the bytes it sends are never parsed)."""

    def __init__(self, response: bytes) -> None:
        self.response = response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.response)  # buffered; close() flushes it first
        transport.close()


class FirstRequestDeadline:
    """Closes a connection whose first request has not reached the application (its headers
    complete) within ``timeout_s`` seconds of the connection opening.

    ``GuardedTCPSite`` calls ``watch`` for every connection it hands to aiohttp; ``middleware``
    (the application's outermost) marks the connection's request as started. aiohttp arms its
    ``keepalive_timeout`` at connection start itself only from 3.14.4; before that, a client that
    drips its first request's headers, or sends nothing, keeps its connection for ever.

    Raises:
        ValueError: ``timeout_s`` <= 0.
    """

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._waiting: set[web.RequestHandler] = set()  # no request started yet

    def watch(self, protocol: web.RequestHandler) -> None:
        """Start ``protocol``'s deadline (call from the event loop, as it is created)."""
        self._waiting.add(protocol)
        asyncio.get_running_loop().call_later(self.timeout_s, self._expire, protocol)

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        self._waiting.discard(request.protocol)
        return await handler(request)

    def _expire(self, protocol: web.RequestHandler) -> None:
        if protocol in self._waiting:
            self._waiting.discard(protocol)
            protocol.force_close()  # closes its transport (no-op if the client already left)


FIRST_REQUEST_DEADLINE = web.AppKey("first_request_deadline", FirstRequestDeadline)


class GuardedTCPSite(web.BaseSite):
    """``web.TCPSite`` with at most about ``max_connections`` open connections (a burst accepted
    within one event-loop turn may pass it by the listen backlog), each watched by
    ``first_request`` if given."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        first_request: FirstRequestDeadline | None = None,
    ):
        super().__init__(runner)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.first_request = first_request
        self._full = _full_response(max_connections)

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        if len(server.connections) >= self.max_connections:
            return _RefuseConnection(self._full)
        protocol = server()
        if self.first_request is not None:
            self.first_request.watch(protocol)
        return protocol

    async def start(self) -> None:
        """Bind and listen. Raises OSError if the address cannot be bound."""
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol, self.host, self.port, backlog=self._backlog, reuse_address=True
        )


async def wait_within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """``await awaitable`` for at most ``timeout_s`` seconds (None: no limit), as
    ``asyncio.wait_for``, but a cancellation of the caller is never lost.

    Before Python 3.12, ``wait_for`` returns the awaitable's result when the caller is cancelled in
    the event-loop iteration in which the awaitable completes (CPython gh-86296). A handler that a
    client's disconnect cancelled while its engine output arrived then ran its request to the end:
    aiohttp cancels a handler once.

    Raises:
        asyncio.TimeoutError: ``timeout_s`` passed first; the awaitable is cancelled.
        asyncio.CancelledError: the caller was cancelled; the awaitable is cancelled.
    """
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((inner,), timeout=timeout_s)
    finally:
        inner.cancel()  # a no-op once it is done
    if not done:
        raise asyncio.TimeoutError
    return inner.result()


def header_text(request: web.Request, name: str, *, status: int = 400) -> str | None:
    """Header ``name`` as text, or None if absent.

    Raises:
        ProtocolError (``status``): the value holds bytes that are not UTF-8, naming the header
            and the first such byte.
    """
    value = request.headers.get(name)
    if value is None or value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = value[e.start].encode("utf-8", "surrogateescape")[0]
        raise ProtocolError(
            f"the {name} header is not UTF-8 (byte 0x{byte:02x} at offset {e.start})",
            status=status,
        ) from None
    return value


def _bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer TOKEN``. Raises ProtocolError (401) for a header
    that is not UTF-8 (no key can match it)."""
    scheme, _, token = (header_text(request, "Authorization", status=401) or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _unauthorized(message: str) -> web.Response:
    body = error_body(message, status=401)
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


# routes that need the key besides /v1/*: the profiler's, which write traces to the server's disk
KEYED_PATHS = ("/v1", "/start_profile", "/stop_profile")


def api_key_middleware(api_keys: tuple[str, ...]):
    """vLLM's ``--api-key``: ``/v1/*`` and ``KEYED_PATHS`` answer 401 (OpenAI error object)
    unless the request carries ``Authorization: Bearer KEY`` with one of ``api_keys`` (compared
    in constant time)."""
    encoded = tuple(key.encode() for key in api_keys)

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in KEYED_PATHS:
            try:
                token = (_bearer_token(request) or "").encode()
            except ProtocolError as e:
                return _unauthorized(f"{e}; send Authorization: Bearer KEY")
            # every key compared, so the time taken does not say which one nearly matched
            matches = [hmac.compare_digest(token, key) for key in encoded]
            if not any(matches):
                return _unauthorized("missing or wrong API key (Authorization: Bearer KEY)")
        return await handler(request)

    return check_api_key


def require_json(request: web.Request) -> None:
    """Raise ProtocolError (415) unless the request says its body is JSON (``application/json``
    or ``application/*+json``, any charset parameter); ProtocolError (400) for a Content-Type
    that is not UTF-8."""
    content_type = header_text(request, "Content-Type")
    kind = request.content_type.lower()
    if content_type is None or not (
        kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
    ):
        got = "no Content-Type" if content_type is None else f"{content_type[:80]!r}"
        raise ProtocolError(
            f"the body must be JSON (Content-Type: application/json), got {got}", status=415
        )
