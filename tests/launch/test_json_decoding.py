"""Large request bodies decoded in the JSON worker process: the same values and the same error
messages as in this process; a worker that dies costs no request, and a body that kills it is
refused without ever running in this process; nesting past ``MAX_JSON_DEPTH`` is refused before
``json.loads`` on every interpreter."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor

import pytest

from launch.serving.json_decoding import (
    MAX_JSON_DEPTH,
    TOO_DEEP,
    JsonDecoder,
    decode,
    nested_deeper_than,
)

BODIES = [
    (b'{"prompt": [1, 2, 3], "max_tokens": 4}', "utf-8"),
    (b'{"prompt": "caf\\u00e9 \\ud800"}', "utf-8"),  # a lone surrogate is valid JSON
    (b'{"prompt": [12345678901234567890123]}', "utf-8"),  # stays an int
    (b"{not json", "utf-8"),
    ("[" * 100_000 + "]" * 100_000, "utf-8"),
    (b"\xff\xfe", "utf-8"),
    (b"{}", "no-such-charset"),
]


def _bodies():
    return [(b.encode() if isinstance(b, str) else b, c) for b, c in BODIES]


def test_the_worker_decodes_exactly_as_this_process():
    async def run():
        decoder = JsonDecoder()
        try:
            return [await decoder.decode(raw, charset) for raw, charset in _bodies()]
        finally:
            decoder.close()

    in_worker = asyncio.run(run())
    here = [decode(raw, charset) for raw, charset in _bodies()]
    assert in_worker == here
    assert [ok for ok, _ in here] == [True, True, True, False, False, False, False]
    assert here[2][1] == {"prompt": [12345678901234567890123]}
    assert here[4][1] == TOO_DEEP
    assert here[6][1].startswith("unknown charset 'no-such-charset'")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_dead_worker_costs_no_request():
    async def run():
        decoder = JsonDecoder()
        try:
            first = await decoder.decode(b"[1]", "utf-8")
            for pid in list(decoder._pool._processes):  # the worker of the first body
                os.kill(pid, signal.SIGKILL)
            second = await decoder.decode(b"[2]", "utf-8")  # the pool broke: a new worker
            third = await decoder.decode(b"[3]", "utf-8")  # the same new worker
            return first, second, third
        finally:
            decoder.close()

    assert asyncio.run(run()) == ((True, [1]), (True, [2]), (True, [3]))


def test_a_body_that_kills_the_worker_twice_is_refused(monkeypatch):
    """Workers that die at start (as one crashed by a body would): the body is tried in two
    workers, then refused (there is no decoding in this process to fall back to)."""
    starts = []

    def dying_pool():
        starts.append(1)
        return ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=os._exit, initargs=(3,)
        )

    monkeypatch.setattr(JsonDecoder, "_new_pool", staticmethod(dying_pool))

    async def run():
        decoder = JsonDecoder()
        try:
            return await decoder.decode(b"[1]", "utf-8")
        finally:
            decoder.close()

    assert asyncio.run(run()) == (False, "the request body killed the JSON decoder process twice")
    assert len(starts) == 2


def test_nesting_is_measured_outside_strings():
    limit = 3
    assert not nested_deeper_than("[[[1]]]", limit)
    assert nested_deeper_than('[{"a": [[2]]}]', limit)
    assert not nested_deeper_than('[["[[[[", "\\"], "\\"[[["]', limit)  # brackets in strings
    assert not nested_deeper_than("[1], [2], [3], [4], [5]", limit)  # many, none inside another
    assert nested_deeper_than('[["x[[[[', limit)  # an unterminated string's brackets count


def test_decode_takes_max_depth_and_refuses_one_more():
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    ok, value = decode(deepest.encode(), "utf-8")
    assert ok and isinstance(value, list)
    assert decode(("[" + deepest + "]").encode(), "utf-8") == (False, TOO_DEEP)
