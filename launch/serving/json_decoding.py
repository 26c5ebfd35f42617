"""Request bodies decoded as JSON, large ones in a worker process.

``json.loads`` holds the GIL for its whole call: 20-40 ms for a 1 MiB body of token ids on these
CPUs, during which the server's event loop (``/health`` included) cannot run. ``JsonDecoder``
decodes a large body in one spawned worker process instead (stdlib only: this module imports
neither torch nor aiohttp) and hands the value back pickled, which the server loads about four
times faster than it would parse the JSON. The error messages are made here once, for both
paths.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool


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
    try:
        return True, json.loads(text)
    except RecursionError:
        return False, "the request body is JSON nested too deeply"
    except ValueError as e:  # JSONDecodeError, or an int past Python's digit limit
        return False, f"the request body is not valid JSON ({str(e)[:200]})"


class JsonDecoder:
    """One worker process that decodes large bodies (started on first use; ``close`` ends it)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def decode(self, raw: bytes, charset: str) -> tuple[bool, object]:
        """``decode(raw, charset)`` run in the worker process (on a thread of this process if
        the worker died: a new one is started for the next body)."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            return await loop.run_in_executor(self._pool, decode, raw, charset)
        except BrokenProcessPool:
            self._pool = None
            return await loop.run_in_executor(None, decode, raw, charset)

    def close(self) -> None:
        """End the worker process (without waiting for a body it is decoding)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
