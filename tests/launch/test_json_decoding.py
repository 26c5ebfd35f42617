"""Large request bodies decoded in the JSON decoder's worker processes: the same values and the
same error messages as in this process; a worker that dies costs no request; two dead workers are
the server's fault (503), or a 500 for a body that crashed both, never a 400 and never decoded in
this process; the workers end with their server however it dies, and import no torch; nesting past
``MAX_JSON_DEPTH`` is refused before ``json.loads`` on every interpreter."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launch.serving import json_decoding
from launch.serving.json_decoding import (
    MAX_JSON_DEPTH,
    TOO_DEEP,
    JsonDecoder,
    decode,
    nested_deeper_than,
)

REPO = Path(__file__).resolve().parents[2]
BODIES = [
    (b'{"prompt": [1, 2, 3], "max_tokens": 4}', "utf-8"),
    (b'{"prompt": "caf\\u00e9 \\ud800"}', "utf-8"),  # a lone surrogate is valid JSON
    (b'{"prompt": [12345678901234567890123]}', "utf-8"),  # stays an int
    (b"{not json", "utf-8"),
    ("[" * 100_000 + "]" * 100_000, "utf-8"),
    (b"\xff\xfe", "utf-8"),
    (b"{}", "no-such-charset"),
    ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "utf-8"),  # pickled back at the deepest
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
    assert [ok for ok, _ in here] == [True, True, True, False, False, False, False, True]
    assert here[2][1] == {"prompt": [12345678901234567890123]}
    assert here[4][1] == TOO_DEEP
    assert here[6][1].startswith("unknown charset 'no-such-charset'")


def test_a_dead_worker_costs_no_request():
    async def run():
        decoder = JsonDecoder()
        try:
            first = await decoder.decode(b"[1]", "utf-8")
            killed = decoder.worker_pids
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            second = await decoder.decode(b"[2]", "utf-8")  # a dead worker: a new one
            third = await decoder.decode(b"[3]", "utf-8")
            return (first, second, third), killed, decoder.worker_pids
        finally:
            decoder.close()

    answers, killed, now = asyncio.run(run())
    assert answers == ((True, [1]), (True, [2]), (True, [3]))
    assert len(killed) == 2 and not set(killed) & set(now)


def _dying_workers(monkeypatch, how: signal.Signals) -> list[int]:
    """Every decoder worker started from now on reads a request's head, then sends itself
    ``how``; the returned list counts the starts."""
    starts = []
    script = (
        "import os, resource, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
        f"sys.stdin.buffer.read(8); os.kill(os.getpid(), {int(how)})"
    )

    def command(parent_pid: int) -> list[str]:
        starts.append(parent_pid)
        return [sys.executable, "-I", "-S", "-c", script]

    monkeypatch.setattr(json_decoding, "worker_command", command)
    return starts


def _decode_once(decoder_kwargs=None):
    async def run():
        decoder = JsonDecoder(**(decoder_kwargs or {}))
        try:
            return await decoder.decode(b"[1]", "utf-8")
        finally:
            decoder.close()

    return asyncio.run(run())


def test_two_killed_workers_are_the_servers_fault(monkeypatch):
    """Workers killed from outside (the OOM killer, an operator) while decoding: the body is
    tried until two workers started for it have died, then refused as unavailable (503), not as
    the client's fault."""
    starts = _dying_workers(monkeypatch, signal.SIGKILL)
    with pytest.raises(
        json_decoding.DecoderUnavailable, match=r"died while decoding .*\(SIGKILL, then SIGKILL\)"
    ):
        _decode_once()
    assert len(starts) == 4  # the two started on first use (not for the body), two for it


def test_a_body_that_crashes_two_workers_is_refused_with_a_server_error(monkeypatch):
    starts = _dying_workers(monkeypatch, signal.SIGSEGV)
    with pytest.raises(json_decoding.BodyCrashedDecoder, match=r"\(SIGSEGV, then SIGSEGV\)"):
        _decode_once({"num_workers": 1})
    assert len(starts) == 3  # the one started on first use, two for the body, none more


def test_a_stalled_worker_is_replaced_at_the_deadline():
    async def run():
        decoder = JsonDecoder(num_workers=1, timeout_s=0.5)
        try:
            assert await decoder.decode(b"[1]", "utf-8") == (True, [1])
            (stalled,) = decoder.worker_pids
            os.kill(stalled, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(json_decoding.DecoderUnavailable, match="no answer within 0.5 s"):
                await decoder.decode(b"[2]", "utf-8")
            took = time.monotonic() - start
            return took, stalled, await decoder.decode(b"[3]", "utf-8"), decoder.worker_pids
        finally:
            decoder.close()

    took, stalled, answer, now = asyncio.run(run())
    assert 0.5 <= took < 5, took
    assert answer == (True, [3]) and stalled not in now
    assert _is_gone(stalled)


def _slow_to_refuse(num_bytes: int) -> bytes:
    """About ``num_bytes`` of arrays nested 500 deep, then one nested past ``MAX_JSON_DEPTH``:
    the nesting scan walks every bracket before it refuses the body (a short answer)."""
    unit = "[" * 500 + "]" * 500
    units = [unit] * (num_bytes // (len(unit) + 1))
    deepest = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    return ("[" + ",".join([*units, deepest]) + "]").encode()


def test_a_small_body_is_not_held_up_by_large_slow_ones():
    """Three large bodies, slow to decode, arrive first: one worker is left to the 70 KiB body,
    which is answered before any of them."""
    large, small = _slow_to_refuse(1 << 20), b"[1]" + b" " * (70 * 1024)

    async def run():
        decoder = JsonDecoder()  # two workers
        done = []

        async def timed(name, raw):
            answer = await decoder.decode(raw, "utf-8")
            done.append(name)
            return answer

        try:
            await decoder.decode(b"[0]", "utf-8")  # the workers are up
            larger = [asyncio.ensure_future(timed(f"large {i}", large)) for i in range(3)]
            await asyncio.sleep(0.05)  # they are handed their workers first
            answer = await timed("small", small)
            answers = await asyncio.gather(*larger)
            return done, answer, answers
        finally:
            decoder.close()

    done, answer, answers = asyncio.run(run())
    assert answer == (True, [1]) and answers == [(False, TOO_DEEP)] * 3
    assert done[0] == "small", done


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        JsonDecoder(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0, got nan"):
        JsonDecoder(timeout_s=float("nan"))


# A server process that owns a decoder, decodes one large body, prints the answer and waits to be
# killed. Its __main__ module imports torch, as ``launch.serve``'s does: a worker started by
# multiprocessing's spawn imports it again.
PARENT = """
import asyncio, time
import torch
from launch.serving.json_decoding import JsonDecoder

if __name__ == "__main__":
    decoder = JsonDecoder()
    print(asyncio.run(decoder.decode(b"[1]", "utf-8")), flush=True)
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """(the server process, the pids of its children: the decoder's processes)."""
    script = tmp_path_factory.mktemp("server") / "server_main.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=script.parent, env=env, stdout=subprocess.PIPE, text=True
    )
    children = []
    try:
        with ThreadPoolExecutor(1) as reader:  # blocking read, with a timeout
            line = reader.submit(proc.stdout.readline).result(timeout=180)
        assert line.strip() == "(True, [1])", line
        children = _children(proc.pid)
        assert children, "the server started no decoder process"
        yield proc, children
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for pid in children:  # ours, if they outlived the server
            if not _is_gone(pid):
                os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) and int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def _is_gone(pid: int) -> bool:
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"  # a zombie has exited: only its reaping is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_import_no_torch(server_process):
    _, children = server_process
    for pid in children:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "torch" not in maps, f"decoder process {pid} has torch's libraries mapped"
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = int(status.split("VmRSS:")[1].split()[0])
        assert rss_kib < 64 * 1024, f"decoder process {pid} holds {rss_kib} KiB"
    # what the worker's module imports, run as the worker runs
    probe = textwrap.dedent(
        f"""
        import runpy, sys
        runpy.run_path({str(REPO / "launch/serving/json_worker.py")!r})
        print(" ".join(sorted(sys.modules)))
        """
    )
    command = json_decoding.worker_command(os.getpid())[:3]
    modules = subprocess.run(
        [*command, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert "json" in modules and "pickle" in modules
    assert not [m for m in modules if m.split(".")[0] in ("torch", "launch", "aiohttp", "numpy")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_end_when_their_server_is_sigkilled(server_process):
    """No decoder process, and no multiprocessing resource tracker, outlives a SIGKILLed server
    (run after the test above: it kills the server)."""
    proc, children = server_process
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while not all(map(_is_gone, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in children if not _is_gone(pid)] == []


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
