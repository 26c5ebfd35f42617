"""Large request bodies decoded in the JSON worker process: the same values and the same error
messages as in this process, and a worker that dies costs no request."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from launch.serving.json_decoding import JsonDecoder, decode

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
    assert here[4][1] == "the request body is JSON nested too deeply"
    assert here[6][1].startswith("unknown charset 'no-such-charset'")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_dead_worker_costs_no_request():
    async def run():
        decoder = JsonDecoder()
        try:
            first = await decoder.decode(b"[1]", "utf-8")
            for pid in list(decoder._pool._processes):  # the worker of the first body
                os.kill(pid, signal.SIGKILL)
            second = await decoder.decode(b"[2]", "utf-8")  # on a thread: the pool broke
            third = await decoder.decode(b"[3]", "utf-8")  # a new worker
            return first, second, third
        finally:
            decoder.close()

    assert asyncio.run(run()) == ((True, [1]), (True, [2]), (True, [3]))
