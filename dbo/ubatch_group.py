"""The baton shared by one step's ubatch threads (``dbo.ubatch_context.UBatchContext``'s state).

A ring of binary semaphores: exactly one ubatch holds the baton; handing it on releases the next
unfinished ubatch's permit. Every wait has a timeout; an abort releases every permit so that all
waiters return and raise ``UBatchAborted``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Extra time a baton wait gives the holder after its timeout, so that a holder blocked in a
# collective reports that collective's timeout (naming it) rather than this wait's (<= 1 s).
BATON_GRACE_S = 1.0

# Called as observer(ubatch_id, handed_at_ns, woke_at_ns) by a ubatch thread that just received the
# baton from another one (the timeline records baton passes through it); None: nobody listens.
_baton_observer: Callable[[int, int, int], None] | None = None


def set_baton_observer(observer: Callable[[int, int, int], None] | None) -> None:
    """Install (None: remove) the process-wide baton-pass observer (``dbo.timeline`` does)."""
    global _baton_observer
    _baton_observer = observer


class UBatchAborted(RuntimeError):
    """Raised in a ubatch thread because another ubatch failed (the cause is chained)."""


class UBatchGroup:
    """State shared by the contexts of one step.

    ``lock`` guards the state. The baton itself is a permit: ``wake[i]`` is a plain lock used as a
    binary semaphore (released = ubatch ``i`` may run), the cheapest cross-thread handoff Python
    has (a Condition allocates a lock per wait and notifies through a waiter list). Invariant:
    outside an abort there is exactly one permit in the ring, owned by ``owner``; a ubatch consumes
    its permit when it starts running and gives the next one a permit when it hands on.
    """

    def __init__(self, num_ubatches: int, timeout_s: float) -> None:
        self.num_ubatches = num_ubatches
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.wake = [threading.Lock() for _ in range(num_ubatches)]
        for wake in self.wake[1:]:
            wake.acquire()  # no permit yet; ubatch 0 holds the baton first
        self.owner = 0
        self.finished = [False] * num_ubatches
        self.hooks: list[list[Callable[[], None]]] = [[] for _ in range(num_ubatches)]
        self.error: BaseException | None = None
        self.last_progress_ns = time.perf_counter_ns()
        self.handed_at_ns: int | None = None  # when the baton last went to another ubatch
        # CUDA: the event the last owner recorded before handing on (None on CPU)
        self.handed_event: torch.cuda.Event | None = None

    # next_unfinished, previous_unfinished, hand_on, raise_if_aborted and abort are called with
    # self.lock held

    def next_unfinished(self, ubatch_id: int) -> int:
        """The next ubatch in the ring after ``ubatch_id`` that has not finished (maybe itself)."""
        for step in range(1, self.num_ubatches + 1):
            candidate = (ubatch_id + step) % self.num_ubatches
            if not self.finished[candidate]:
                return candidate
        return ubatch_id

    def previous_unfinished(self, ubatch_id: int) -> int:
        """The unfinished ubatch that runs last before the baton comes back to ``ubatch_id``: the
        previous one in the ring, skipping finished ones (``ubatch_id`` itself if all others
        finished; with two ubatches, the other one)."""
        for step in range(1, self.num_ubatches + 1):
            candidate = (ubatch_id - step) % self.num_ubatches
            if not self.finished[candidate]:
                return candidate
        return ubatch_id

    def hand_on(self, ubatch_id: int) -> int:
        """Give the baton to the next unfinished ubatch; return it (``ubatch_id`` if none)."""
        self.owner = self.next_unfinished(ubatch_id)
        self.last_progress_ns = now_ns = time.perf_counter_ns()
        if self.owner != ubatch_id:
            self.handed_at_ns = now_ns
            if self.wake[self.owner].locked():
                self.wake[self.owner].release()
        return self.owner

    def raise_if_aborted(self, ubatch_id: int) -> None:
        if self.error is not None:
            raise UBatchAborted(
                f"ubatch {ubatch_id} stopped because another ubatch failed: {self.error!r}"
            ) from self.error

    def abort(self, error: BaseException) -> None:
        """Record the first error and give every ubatch a permit, so that all waits return."""
        if self.error is None:
            self.error = error
        self.last_progress_ns = time.perf_counter_ns()
        for wake in self.wake:
            if wake.locked():
                wake.release()

    def wait_for_baton(self, ubatch_id: int, what: str) -> None:
        """Block until ``ubatch_id`` holds the baton (called WITHOUT self.lock held)."""
        # blocking wait (timeout self.timeout_s): for the baton, or for an abort
        has_permit = self.wake[ubatch_id].acquire(timeout=self.timeout_s)
        if not has_permit:
            # The holder may be blocked in a collective whose own timeout (the same length, begun
            # just after this wait) names the collective: give it a grace to report that first.
            grace_s = min(self.timeout_s, BATON_GRACE_S)
            has_permit = self.wake[ubatch_id].acquire(timeout=grace_s)  # blocking wait, grace_s
        woke_at_ns = time.perf_counter_ns()
        with self.lock:
            handed_at_ns = self.handed_at_ns
            self.raise_if_aborted(ubatch_id)
            if not has_permit:
                raise TimeoutError(
                    f"ubatch {ubatch_id} waited {self.timeout_s:g} s for the baton {what}; ubatch "
                    f"{self.owner} holds it and never yielded or finished"
                )
            if self.owner != ubatch_id:  # cannot happen while the invariant holds
                raise RuntimeError(
                    f"ubatch {ubatch_id} woke up but ubatch {self.owner} holds the baton"
                )
        observer = _baton_observer
        if observer is not None and handed_at_ns is not None:
            observer(ubatch_id, handed_at_ns, woke_at_ns)
