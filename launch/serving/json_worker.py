"""JSON request bodies decoded (``decode``, the one definition), and the decoder worker process that
does it for large ones when this module runs as a script (standard library only). The pipe
protocol, how a worker ends with its server, and ``MAX_JSON_DEPTH``:
docs/serving.md#json-decoding-in-worker-processes."""

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
