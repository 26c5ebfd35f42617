"""Which peer rank stopped answering: rendezvous-store heartbeats (``Heartbeat``), read when a
collective fails (``describe_failure``). How and what it cannot see: docs/backends.md, "Liveness:
naming a silent rank"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

KEY_PREFIX = "moe_dbo/heartbeat/"
DEFAULT_INTERVAL_S = 0.25
# How long a diagnosis may take before it gives up (the store itself may be unreachable).
DIAGNOSIS_TIMEOUT_S = 5.0


def _default_store():
    """The default process group's store, or None (private torch API: diagnosis is best effort)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no group, or a torch without this helper
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class SilentRanks:
    """Result of a diagnosis: ``ranks`` that stopped counting, or why none could be named."""

    ranks: tuple[int, ...]
    note: str = ""  # set when the diagnosis could not run or found every rank alive

    def describe(self) -> str:
        if self.ranks:
            names = ", ".join(str(r) for r in self.ranks)
            return f"rank(s) {names} stopped answering (no heartbeat)"
        return self.note


class Heartbeat:
    """This rank's heartbeat thread, and the diagnosis of the others'. Start after the default
    process group exists; ``stop`` on exit (the thread is a daemon either way)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store=None,
        interval_s: float = DEFAULT_INTERVAL_S,
        should_beat: Callable[[], bool] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        # False once the store is known to be gone (its host, the launcher, exited): the thread
        # ends instead of a store call that fails with torch's multi-line warning
        self.should_beat = should_beat or (lambda: True)
        self.store = store if store is not None else _default_store()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        if self.store is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        key = f"{KEY_PREFIX}{self.rank}"
        while not self._stop.is_set() and self.should_beat():
            try:
                self.store.add(key, 1)  # blocking store call (the store's own timeout)
            except Exception:  # noqa: BLE001 - store gone: the job is ending anyway
                return
            self._stop.wait(self.interval_s)  # blocking wait, interval_s

    def _counters(self) -> list[int]:
        return [self.store.add(f"{KEY_PREFIX}{r}", 0) for r in range(self.world_size)]

    def silent_ranks(self, timeout_s: float = DIAGNOSIS_TIMEOUT_S) -> SilentRanks:
        """The peer ranks whose heartbeat did not move over ``2 * interval_s + 0.1`` s.

        Takes that long (and at most ``timeout_s``: the store may be unreachable too).
        """
        if self.store is None:
            return SilentRanks(ranks=(), note="no store to read heartbeats from")
        result: list[SilentRanks] = []

        def diagnose() -> None:
            try:
                before = self._counters()
                time.sleep(2 * self.interval_s + 0.1)
                after = self._counters()
            except Exception as e:  # noqa: BLE001 - reported as the note
                result.append(SilentRanks(ranks=(), note=f"heartbeats unreadable ({e})"))
                return
            silent = tuple(
                r for r in range(self.world_size) if r != self.rank and after[r] == before[r]
            )
            note = "" if silent else "every rank's heartbeat is alive (a rank is stuck, not frozen)"
            result.append(SilentRanks(ranks=silent, note=note))

        thread = threading.Thread(target=diagnose, name="heartbeat-diagnosis", daemon=True)
        thread.start()
        thread.join(timeout_s)  # blocking wait, timeout_s
        if not result:
            return SilentRanks(ranks=(), note=f"the store did not answer within {timeout_s:g} s")
        return result[0]


def describe_failure(error: BaseException, heartbeat: Heartbeat | None) -> str:
    """``error`` as one line; for a timeout, followed by which peer ranks stopped answering."""
    message = f"{type(error).__name__}: {error}"
    is_timeout = isinstance(error, TimeoutError) or "timed out" in str(error).lower()
    if heartbeat is None or not is_timeout:
        return message
    return f"{message}; {heartbeat.silent_ranks().describe()}"
