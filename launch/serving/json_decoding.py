"""Request bodies decoded as JSON, large ones in a small pool of worker processes (``JsonDecoder``,
``launch.serving.json_worker``), so that ``json.loads``, which holds the GIL, never stalls the
event loop: deadlines, retries after a worker's death, and scheduling by body size. What a
client gets when decoding fails: docs/serving.md#json-decoding-in-worker-processes."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launch.serving.http_guard import wait_within
from launch.serving.json_worker import (
    ANSWER_HEAD,
    MAX_JSON_DEPTH,
    REQUEST_HEAD,
    TOO_DEEP,
    decode,
    nested_deeper_than,
    read_exactly,
)

__all__ = [
    "MAX_JSON_DEPTH",
    "TOO_DEEP",
    "BodyCrashedDecoder",
    "DecoderUnavailable",
    "JsonDecoder",
    "decode",
    "nested_deeper_than",
    "worker_command",
]

logger = logging.getLogger("launch.serving")

NUM_WORKERS = 2
DECODE_TIMEOUT_S = 10.0  # a 1 MiB body takes well under 1 s; a stuck worker is replaced after it
RESERVED_BELOW_BYTES = 256 * 1024  # bodies this size or more leave one worker to smaller ones
# How a process falls by its own fault (the C decoder crashing), unlike a kill from outside
CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}
)
REAP_TIMEOUT_S = 5.0  # a worker whose stdout closed has exited; reaping it takes no longer


class DecoderUnavailable(RuntimeError):
    """The body was not decoded in time, or its workers were killed: the server's fault, and a
    retry may succeed (HTTP 503 with ``Retry-After``)."""


class BodyCrashedDecoder(RuntimeError):
    """Two worker processes crashed decoding the body: it is refused (HTTP 500)."""


def worker_command(parent_pid: int) -> list[str]:
    """The command line of a decoder worker for the server process ``parent_pid``: this
    interpreter, isolated (``-I -S``), running ``launch/serving/json_worker.py`` as a script."""
    worker = Path(__file__).with_name("json_worker.py")
    return [sys.executable, "-I", "-S", str(worker), str(parent_pid)]


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-returncode).name
    return f"exit status {returncode}"


class _Worker:
    """One place in the pool: its process, started on demand, replaced once it has died."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.holds_large = False  # decoding a body of reserved_below_bytes or more
        self.started_for: int | None = None  # the body (arrival number) the process started for

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_started(self, started_for: int | None = None) -> None:
        """Start a process (for body ``started_for``) unless one runs. From the event loop's
        thread: the worker's ``PR_SET_PDEATHSIG`` fires when the thread that started it exits."""
        if not self.is_running:
            self.proc = subprocess.Popen(
                worker_command(os.getpid()), stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            self.started_for = started_for

    def roundtrip(self, raw: bytes, charset: str) -> tuple[str, object] | int:
        """The worker's answer to one body (``(kind, value)``, see ``json_worker``), or its exit
        status once it has died. On an I/O thread: blocking writes and reads, which end when the
        process does (``kill``)."""
        proc = self.proc
        charset_bytes = charset.encode("utf-8", "surrogateescape")
        payload = None
        try:
            proc.stdin.write(REQUEST_HEAD.pack(len(raw), len(charset_bytes)) + charset_bytes)
            proc.stdin.write(raw)
            proc.stdin.flush()
            head = read_exactly(proc.stdout, ANSWER_HEAD.size)
            if head is not None:
                payload = read_exactly(proc.stdout, ANSWER_HEAD.unpack(head)[0])
        except (OSError, ValueError):  # a broken or closed pipe: the process is gone
            pass
        if payload is None:
            return _reap(proc)
        return pickle.loads(payload)

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()


def _reap(proc: subprocess.Popen) -> int:
    """Wait for ``proc`` to exit (killing it past ``REAP_TIMEOUT_S``), close its pipes; its
    return code."""
    try:
        proc.wait(timeout=REAP_TIMEOUT_S)  # blocking wait, with a timeout
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=REAP_TIMEOUT_S)
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError, ValueError):
            pipe.close()
    return proc.returncode


class JsonDecoder:
    """``num_workers`` worker processes that decode large bodies (all started on first use;
    ``close`` ends them), each body within ``timeout_s`` seconds.

    Raises:
        ValueError: ``num_workers`` < 1, ``timeout_s`` <= 0 or ``reserved_below_bytes`` < 0.
    """

    def __init__(
        self,
        *,
        num_workers: int = NUM_WORKERS,
        timeout_s: float = DECODE_TIMEOUT_S,
        reserved_below_bytes: int = RESERVED_BELOW_BYTES,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if reserved_below_bytes < 0:
            raise ValueError(f"reserved_below_bytes must be >= 0, got {reserved_below_bytes}")
        self.timeout_s = timeout_s
        self.reserved_below_bytes = reserved_below_bytes
        self._workers = [_Worker() for _ in range(num_workers)]
        self._idle = self._workers[::-1]  # popped from the end: the first worker first
        self._num_large_busy = 0
        self._waiting: list[tuple[int, int, int, asyncio.Future]] = []  # a heap: smallest first
        self._arrivals = itertools.count()
        self._io = ThreadPoolExecutor(num_workers, thread_name_prefix="json-decoder")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_closed = False

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The process ids of the running workers."""
        return tuple(w.proc.pid for w in self._workers if w.is_running)

    async def decode(self, raw: bytes, charset: str) -> tuple[bool, object]:
        """``json_worker.decode(raw, charset)`` run in a worker process.

        Raises:
            DecoderUnavailable: the decoder is closed, no answer came within ``timeout_s``, or
                the workers died decoding the body, not two started for it both by a crash.
            BodyCrashedDecoder: two workers started for the body crashed decoding it.
            RuntimeError: the worker raised an unexpected exception (a server bug).
        """
        if self._is_closed:
            raise DecoderUnavailable("the JSON decoder is closed: the server is stopping")
        loop = self._loop = asyncio.get_running_loop()
        if not any(w.proc for w in self._workers):
            for worker in self._workers:  # on first use: no body waits for a start later
                worker.ensure_started()
        deadline = loop.time() + self.timeout_s
        arrival = next(self._arrivals)
        deaths: list[int] = []  # of workers started for this body: the body may be the cause
        # a worker that sat idle may have died before the body reached it (killed while idle):
        # its death does not count, and each of them is started again for the next try
        for attempt in range(len(self._workers) + 2):
            worker = await self._acquire(len(raw), arrival, attempt, deadline)
            answer = await self._run(worker, raw, charset, arrival, deadline)
            if not isinstance(answer, int):
                kind, value = answer
                if kind == "failed":
                    raise RuntimeError(f"the JSON decoder worker failed: {value}")
                return value
            if worker.started_for == arrival:
                deaths.append(answer)
            logger.warning(
                "the JSON decoder worker died (%s) decoding a %d-byte body",
                _exit_text(answer),
                len(raw),
            )
            if len(deaths) == 2:
                break
        how = ", then ".join(map(_exit_text, deaths)) or "workers killed while idle"
        if len(deaths) == 2 and all(-code in CRASH_SIGNALS for code in deaths):
            raise BodyCrashedDecoder(
                f"the JSON decoder crashed on this request body in two worker processes started "
                f"for it ({how}); it is refused"
            )
        raise DecoderUnavailable(
            f"the JSON decoder's worker processes died while decoding this request body ({how})"
        )

    async def _acquire(self, size: int, arrival: int, attempt: int, deadline: float) -> _Worker:
        """A worker for a body of ``size`` bytes, by ``deadline`` (loop time)."""
        waiter = self._loop.create_future()
        heapq.heappush(self._waiting, (size, arrival, attempt, waiter))
        self._dispatch()
        try:  # blocking wait for a worker, until the deadline
            return await wait_within(waiter, max(0.0, deadline - self._loop.time()))
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():  # handed over as the wait ended
                self._release(waiter.result())
            if isinstance(e, asyncio.TimeoutError):
                raise DecoderUnavailable(
                    f"no JSON decoder worker was free within {self.timeout_s:g} s "
                    f"({len(self._waiting)} bodies waiting)"
                ) from None
            raise

    async def _run(self, worker: _Worker, raw: bytes, charset: str, arrival: int, deadline: float):
        """``worker.roundtrip`` on an I/O thread, by ``deadline``. The worker returns to the pool
        when its roundtrip ends, whatever becomes of the caller (a client that left)."""
        try:
            worker.ensure_started(arrival)
        except OSError as e:
            self._release(worker)
            raise DecoderUnavailable(f"the JSON decoder worker did not start ({e})") from None
        job = self._io.submit(worker.roundtrip, raw, charset)
        job.add_done_callback(lambda _: self._call_soon(self._release, worker))
        try:  # blocking wait for the worker's answer, until the deadline
            return await wait_within(
                asyncio.wrap_future(job), max(0.0, deadline - self._loop.time())
            )
        except asyncio.TimeoutError:
            worker.kill()  # its roundtrip sees the pipe close and reaps it
            logger.warning(
                "the JSON decoder worker gave no answer within %g s for a %d-byte body: replaced",
                self.timeout_s,
                len(raw),
            )
            raise DecoderUnavailable(
                f"the JSON decoder gave no answer within {self.timeout_s:g} s; "
                "its worker process is replaced"
            ) from None

    def _dispatch(self) -> None:
        """Hand idle workers to the smallest waiting bodies (on the event loop)."""
        max_large = max(1, len(self._workers) - 1)
        while self._idle and self._waiting:
            size, _, _, waiter = self._waiting[0]
            if waiter.done():  # timed out or cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            is_large = size >= self.reserved_below_bytes
            if is_large and self._num_large_busy >= max_large:
                return  # every other waiting body is at least as large
            heapq.heappop(self._waiting)
            # a running worker first: a dead one is started again on the way
            running = [i for i, w in enumerate(self._idle) if w.is_running]
            worker = self._idle.pop(running[-1] if running else -1)
            worker.holds_large = is_large
            self._num_large_busy += is_large
            waiter.set_result(worker)

    def _release(self, worker: _Worker) -> None:
        self._num_large_busy -= worker.holds_large
        worker.holds_large = False
        self._idle.append(worker)
        self._dispatch()

    def _call_soon(self, callback, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nothing to hand back
            self._loop.call_soon_threadsafe(callback, *args)

    def close(self) -> None:
        """End the worker processes (without waiting for a body they are decoding)."""
        self._is_closed = True
        for worker in self._workers:
            worker.kill()
        self._io.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            if worker in self._idle and worker.proc is not None:
                _reap(worker.proc)  # the busy ones are reaped by their roundtrip
