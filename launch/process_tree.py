"""A child command and every process under it, ended together: ``ProcessTree`` starts the command in
a new session and, however its ``with`` block is left, sends SIGTERM to every process under it,
then SIGKILL after ``grace_s``. Why torchrun needs it:
docs/benchmarks.md#process-trees-ending-torchrun-and-its-ranks."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

__all__ = ["DEFAULT_GRACE_S", "ProcessTree", "descendants"]

DEFAULT_GRACE_S = 10.0  # SIGTERM -> SIGKILL; torchrun's own stop of its ranks fits well inside
_live: set[ProcessTree] = set()  # trees still running, for the interpreter's exit


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...; any session), from ``/proc``; ``[]``
    where there is no ``/proc`` (then only the process group can be signalled)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (dead, waiting for its parent to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: os.kill said it exists


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class ProcessTree:
    """``cmd`` started in a new session (``subprocess.Popen(cmd, start_new_session=True,
    **popen_kwargs)``); use it as a context manager. ``wait(timeout_s)`` waits for it;
    ``stop()`` ends it and everything under it (SIGTERM, then SIGKILL after ``grace_s``).

    While the ``with`` block runs in the main thread, SIGTERM and SIGHUP raise ``SystemExit(128 +
    signal)`` in it (their default would end this process without stopping the tree); Ctrl-C's
    ``KeyboardInterrupt`` stops it likewise, and further signals are ignored while it stops. The
    tree is stopped at interpreter exit too.

    Raises:
        ValueError: ``grace_s`` not finite and > 0. OSError: as ``Popen``.
    """

    def __init__(self, cmd: list[str], *, grace_s: float = DEFAULT_GRACE_S, **popen_kwargs):
        if not 0 < grace_s < float("inf"):
            raise ValueError(f"grace_s must be finite and > 0, got {grace_s}")
        self.grace_s = grace_s
        self._previous: dict[int, object] = {}
        self.proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
        _live.add(self)

    def __enter__(self) -> ProcessTree:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, _raise_exit)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous:  # the main thread: a second Ctrl-C or SIGTERM must not cut the stop
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous = signal.signal(sig, signal.SIG_IGN)
                self._previous.setdefault(sig, previous)  # the one from before __enter__
        try:
            self.stop()  # bounded: about twice grace_s
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def wait(self, timeout_s: float) -> int | None:
        """The command's exit status, or None if it still runs after ``timeout_s`` (a blocking
        wait, bounded by ``timeout_s``)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """End the command and every process under it: SIGTERM to each (and to the command's
        process group), SIGKILL to what still runs after ``grace_s``; reaps the command. Nothing
        to do once the command has ended by itself (what it started then belongs to init)."""
        _live.discard(self)
        if self.proc.poll() is not None:  # ended and reaped: its pid may be another's by now
            return
        pids = [*descendants(self.proc.pid), self.proc.pid]  # before any of them dies
        _signal_group(self.proc.pid, signal.SIGTERM)
        _signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:  # bounded by grace_s
            self.proc.poll()  # reap the command itself, so it does not stay a zombie
            pids = [p for p in pids if _is_running(p)]
            if not pids:
                break
            time.sleep(0.05)
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGKILL)
        _signal_all([p for p in pids if _is_running(p)], signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=self.grace_s)  # blocking wait for a SIGKILLed process


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _stop_live_trees() -> None:
    for tree in list(_live):
        tree.stop()
