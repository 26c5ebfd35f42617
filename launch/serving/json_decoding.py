"""Request bodies decoded as JSON, large ones in a worker process.

``json.loads`` holds the GIL for its whole call: 20-40 ms for a 1 MiB body of token ids on these
CPUs, during which the server's event loop (``/health`` included) cannot run. ``JsonDecoder``
decodes a large body in one spawned worker process instead (stdlib only: this module imports
neither torch nor aiohttp) and hands the value back pickled, which the server loads about four
times faster than it would parse the JSON. The error messages are made here once, for both
paths.

Nesting deeper than ``MAX_JSON_DEPTH`` is refused before ``json.loads`` sees the body: how deep the
C decoder goes before it raises ``RecursionError``, and how much stack it takes per level, differ
between interpreters and thread stack sizes, and past the stack a body of brackets crashes the
process. A body that still kills the worker process is retried once in a new worker, then refused;
it never runs in the server's own process.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

# Deepest array / object nesting a request body may have: a chat request with tool schemas nests
# a few dozen levels
MAX_JSON_DEPTH = 512
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_BRACKET = re.compile(r"[\[\]{}]")
TOO_DEEP = f"the request body is JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)"


def nested_deeper_than(text: str, limit: int) -> bool:
    """Whether ``text`` opens more than ``limit`` arrays / objects inside one another (brackets in
    strings do not count; an unterminated string's do). Linear; a body with at most ``limit``
    opening brackets is not scanned."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


def decode(raw: bytes, charset: str) -> tuple[bool, object]:
    """``(True, value)`` of ``raw`` decoded from ``charset`` and parsed as JSON, or ``(False,
    message)`` naming why not (an unknown charset, invalid bytes, invalid or too deeply nested
    JSON, an integer past Python's digit limit)."""
    try:
        text = raw.decode(charset)
    except LookupError:
        return False, f"unknown charset {charset[:40]!r} in the Content-Type header; send UTF-8"
    except UnicodeDecodeError as e:
        return False, f"the request body is not valid {charset} ({e.reason})"
    if nested_deeper_than(text, MAX_JSON_DEPTH):
        return False, TOO_DEEP
    try:
        return True, json.loads(text)
    except RecursionError:  # within MAX_JSON_DEPTH: an interpreter with a lower limit
        return False, TOO_DEEP
    except ValueError as e:  # JSONDecodeError, or an int past Python's digit limit
        return False, f"the request body is not valid JSON ({str(e)[:200]})"


class JsonDecoder:
    """One worker process that decodes large bodies (started on first use; ``close`` ends it)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def decode(self, raw: bytes, charset: str) -> tuple[bool, object]:
        """``decode(raw, charset)`` run in the worker process. If the worker dies (killed, or
        crashed by the body), the body is tried once more in a new worker, then refused."""
        loop = asyncio.get_running_loop()
        for _ in range(2):
            if self._pool is None:
                self._pool = self._new_pool()
            try:
                return await loop.run_in_executor(self._pool, decode, raw, charset)
            except BrokenProcessPool:
                self._pool = None  # the next try, or the next body, starts a new worker
        return False, "the request body killed the JSON decoder process twice"

    @staticmethod
    def _new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def close(self) -> None:
        """End the worker process (without waiting for a body it is decoding)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
