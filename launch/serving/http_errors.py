"""Every HTTP answer of the server is JSON: OpenAI error objects for 4xx/5xx, whatever the input
(``openai_error_middleware``), and ``read_json_body``, which decodes a request body so that no
body can end in anything but a 400, a decoder fault in a 503 or 500.
docs/serving.md#every-answer-is-json."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from launch.serving.json_decoding import (
    DECODE_TIMEOUT_S,
    RESERVED_BELOW_BYTES,
    BodyCrashedDecoder,
    DecoderUnavailable,
    JsonDecoder,
    decode,
)
from launch.serving.openai_protocol import ProtocolError, ServerBusy, error_body

logger = logging.getLogger("launch.serving")

# Request line and header limits handed to aiohttp (its default is 8190 bytes): a long URL reaches
# the router (and gets a JSON 404) instead of the parser's plain-text 400.
MAX_LINE_BYTES = 65536

# A body of at least this many bytes is decoded in the application's JSON worker processes
# (``JSON_DECODER``: json.loads holds the GIL for its whole call; the decoder schedules them) and
# checked (``read_json_body``'s ``parse``) on an executor thread: on the event loop, eight 1 MiB
# token-id bodies stalled /health for seconds. Bodies of ``json_decoding.RESERVED_BELOW_BYTES`` or
# more are checked one at a time (``LARGE_BODY_LOCK``, waited for within the decoder's deadline),
# so the event loop contends for the GIL with one such thread; a smaller body does not wait for
# them (checking 1 MiB of brackets nested 500 deep takes seconds).
LARGE_BODY_BYTES = 64 * 1024
LARGE_BODY_LOCK = web.AppKey("large_body_lock", asyncio.Lock)
JSON_DECODER = web.AppKey("json_decoder", JsonDecoder)


def json_error(message: str, status: int, param: str | None = None) -> web.Response:
    """An OpenAI error object with HTTP ``status``."""
    return web.json_response(error_body(message, status=status, param=param), status=status)


def _http_exception_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"{request.method} {request.path[:200]}: no such route"
    if e.status == 405:
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
        return f"method {request.method} is not allowed on {request.path[:200]}" + (
            f" (allowed: {allowed})" if allowed else ""
        )
    if e.status == 413:
        return f"the request body is too large ({e.text or 'over the server limit'})"
    return e.reason or e.text or f"HTTP {e.status}"


@web.middleware
async def openai_error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Answer aiohttp's HTTP errors and unexpected exceptions with OpenAI error objects."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:  # redirects and the like pass through
            raise
        return json_error(_http_exception_message(request, e), e.status)
    except asyncio.CancelledError:  # the client went away: nothing to answer
        raise
    except ConnectionResetError:  # the client went away mid-stream: not a server error
        logger.debug("client of %s %s went away", request.method, request.path[:200])
        # aiohttp's attempt to send this on the closed transport fails quietly (ConnectionError)
        return json_error("the client closed the connection", 499)
    except Exception:  # noqa: BLE001 - the catch-all 500; the traceback goes to the server log
        logger.exception("unhandled error in %s %s", request.method, request.path[:200])
        return json_error("internal server error (logged on the server)", 500)


async def read_json_body(
    request: web.Request, *, timeout_s: float | None = None, parse: Callable = lambda body: body
):
    """``parse(body)`` of the request body decoded as JSON, read within ``timeout_s`` seconds
    (None: no limit); a body of ``LARGE_BODY_BYTES`` or more is decoded by the application's
    ``JSON_DECODER`` (on the default executor without one) and parsed on the default executor,
    one of ``RESERVED_BELOW_BYTES`` or more under the application's ``LARGE_BODY_LOCK`` if it has
    one.

    Raises:
        ProtocolError (415): a Content-Type other than JSON (``http_guard.require_json``).
        ProtocolError (408): the body did not arrive within ``timeout_s`` (a stalled or dripping
            client); the connection is then closed.
        ProtocolError (400): an unknown charset, bytes that are not valid in it, invalid JSON,
            JSON nested too deeply, or a number beyond Python's integer digit limit.
        ServerBusy (503, ``Retry-After``): the decoder gave no answer within its deadline, or
            its workers were killed (``json_decoding.DecoderUnavailable``), or the checks of the
            large bodies before it did not end within that deadline.
        ProtocolError (500): the body crashed two decoder workers
            (``json_decoding.BodyCrashedDecoder``).
        web.HTTPRequestEntityTooLarge (413): a body over the application's ``client_max_size``.
        Whatever ``parse`` raises.
    """
    from launch.serving.http_guard import require_json, wait_within

    require_json(request)
    try:  # blocking wait for the client's bytes, with a timeout
        raw = await wait_within(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ProtocolError(
            f"the request body did not arrive within {timeout_s:g} s", status=408
        ) from None
    charset = request.charset or "utf-8"
    if len(raw) < LARGE_BODY_BYTES:
        return parse(_value(decode(raw, charset)))
    loop = asyncio.get_running_loop()
    decoder = request.app.get(JSON_DECODER)
    if decoder is None:  # no decoder processes: decoded on a thread
        decoded = await loop.run_in_executor(None, decode, raw, charset)
    else:
        decoded = await _decode_in_worker(decoder, raw, charset)
    lock = request.app.get(LARGE_BODY_LOCK)
    if lock is None or len(raw) < RESERVED_BELOW_BYTES:
        return await loop.run_in_executor(None, lambda: parse(_value(decoded)))
    await _acquire_within(lock, DECODE_TIMEOUT_S if decoder is None else decoder.timeout_s)
    try:
        return await loop.run_in_executor(None, lambda: parse(_value(decoded)))
    finally:
        lock.release()


async def _decode_in_worker(decoder: JsonDecoder, raw: bytes, charset: str):
    """``decoder.decode``, its failures as the server's: ServerBusy (503) or 500."""
    try:
        return await decoder.decode(raw, charset)
    except DecoderUnavailable as e:
        raise ServerBusy(str(e)) from None
    except BodyCrashedDecoder as e:
        raise ProtocolError(str(e), status=500) from None


async def _acquire_within(lock: asyncio.Lock, timeout_s: float) -> None:
    """``lock`` acquired within ``timeout_s``, or ServerBusy (503)."""
    from launch.serving.http_guard import wait_within

    try:  # blocking wait for the checks of the bodies before this one, with a timeout
        await wait_within(lock.acquire(), timeout_s)
    except asyncio.TimeoutError:
        raise ServerBusy(
            f"the large request bodies before this one were not checked within {timeout_s:g} s"
        ) from None


def _value(decoded: tuple[bool, object]):
    """The value of ``json_decoding.decode``'s result; ProtocolError (400) with its message."""
    is_ok, value = decoded
    if not is_ok:
        raise ProtocolError(value)
    return value
