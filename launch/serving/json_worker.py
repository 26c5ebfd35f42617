"""JSON request bodies decoded, and the decoder worker process that does it for large ones.

``decode`` is the one definition of how a body becomes a value or a message; the server runs it
itself for small bodies and ``launch.serving.json_decoding.JsonDecoder`` runs it in worker
processes for large ones. Run as a script, this module is such a worker::

    python -I -S launch/serving/json_worker.py PARENT_PID

It imports the standard library only (``-I -S``: no site-packages, no ``PYTHONPATH``, not the
``launch`` package), so it starts in tens of milliseconds at about 10 MiB, where a worker spawned by
``multiprocessing`` re-imports the server's ``__main__`` and with it torch (230 MiB, seconds).

Pipe protocol (stdin -> stdout, one body at a time): a request is ``struct "<II"`` (body bytes,
charset bytes), the charset (UTF-8, surrogateescape), the body; an answer is ``struct "<Q"``
(payload bytes) and the payload, ``pickle`` of ``("decoded", decode(body, charset))`` or
``("failed", "Type: text")`` for an exception ``decode`` does not turn into a message (a server
bug: 500).

The worker ends with its server, however the server ends: the kernel sends it SIGKILL when the
thread that started it exits (``prctl(PR_SET_PDEATHSIG)``, Linux; it reaches a stopped worker too),
a thread polls the parent pid (every platform), and end-of-file on stdin ends the loop. It ignores
SIGINT: a Ctrl-C reaches the whole foreground process group, and the server, which drains on
SIGINT, still needs its decoder.

Nesting deeper than ``MAX_JSON_DEPTH`` is refused before ``json.loads`` sees the body: how deep the
C decoder goes before it raises ``RecursionError``, and how much stack it takes per level, differ
between interpreters and thread stack sizes, and past the stack a body of brackets crashes the
process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import struct
import sys
import threading
import time

# Deepest array / object nesting a request body may have: a chat request with tool schemas nests
# a few dozen levels
MAX_JSON_DEPTH = 512
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_BRACKET = re.compile(r"[\[\]{}]")
TOO_DEEP = f"the request body is JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)"

REQUEST_HEAD = struct.Struct("<II")  # body bytes, charset bytes
ANSWER_HEAD = struct.Struct("<Q")  # payload bytes
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# pickle recurses per nesting level (two frames each): a value MAX_JSON_DEPTH deep needs more than
# the default limit of 1000
_RECURSION_LIMIT = 4 * MAX_JSON_DEPTH + 200


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


def read_exactly(stream, num_bytes: int) -> bytes | None:
    """``num_bytes`` bytes from the binary ``stream`` (a blocking read), or None at end of file."""
    chunks, missing = [], num_bytes
    while missing:
        chunk = stream.read(missing)
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _answer(raw: bytes, charset: str) -> bytes:
    try:
        payload = pickle.dumps(("decoded", decode(raw, charset)), pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - told to the server, which answers 500
        payload = pickle.dumps(("failed", f"{type(e).__name__}: {str(e)[:300]}"))
    return ANSWER_HEAD.pack(len(payload)) + payload


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent's starting thread exits (Linux), and a poll of the parent pid."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the prctl: nobody to signal us
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(parent_pid: int) -> None:
    """The worker's loop: answer requests from stdin on stdout until end of file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), _RECURSION_LIMIT))
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers goes to the pipe
    while (head := read_exactly(requests, REQUEST_HEAD.size)) is not None:  # blocking read
        num_body, num_charset = REQUEST_HEAD.unpack(head)
        message = read_exactly(requests, num_charset + num_body)
        if message is None:
            return
        charset = message[:num_charset].decode("utf-8", "surrogateescape")
        answers.write(_answer(message[num_charset:], charset))
        answers.flush()


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):  # the server closed its end: no answer wanted
        serve(int(sys.argv[1]))
