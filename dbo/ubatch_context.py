"""The ping-pong protocol between ubatch threads (vLLM's ``UBatchContext`` and ``dbo_*``
functions): the baton ring, recv hooks, timeouts and aborts; every ``dbo_*`` function is a no-op
when DBO is off. The protocol: docs/dbo.md, "The ping-pong protocol" and "Ubatch contexts: baton,
recv hooks, failures"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dbo.forward_context import current_forward_context, enter_ubatch, restore_forward_context
from dbo.ubatch_group import UBatchAborted, UBatchGroup, set_baton_observer

if TYPE_CHECKING:
    from dbo.cuda_streams import UBatchStreams

__all__ = [
    "UBatchAborted",
    "UBatchContext",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_yield",
    "make_ubatch_contexts",
    "set_baton_observer",
]


class UBatchContext:
    """One ubatch's handle on the shared protocol state; make them with ``make_ubatch_contexts``.

    As a context manager: ``__enter__`` makes it the thread's ubatch (``enter_ubatch``) and waits
    for the baton (ubatch 0 holds it first); ``__exit__`` runs this ubatch's pending recv hooks,
    marks it finished and hands the baton on (a finished ubatch is skipped by later passes, so the
    last one's yields return at once). Leaving with an exception aborts the group instead.
    """

    __slots__ = ("id", "_group", "streams", "_outer")

    def __init__(
        self,
        ubatch_id: int,
        group: UBatchGroup,
        streams: UBatchStreams | None = None,
    ) -> None:
        self.id = ubatch_id
        self._group = group
        self.streams = streams  # CUDA streams and events; None on CPU
        self._outer = None  # the thread's forward context before __enter__

    def __repr__(self) -> str:
        return f"UBatchContext(id={self.id}, num_ubatches={self._group.num_ubatches})"

    @property
    def timeout_s(self) -> float:
        return self._group.timeout_s

    @property
    def last_progress_ns(self) -> int:
        """``perf_counter_ns()`` of the group's last baton pass (for watchdogs)."""
        return self._group.last_progress_ns

    def __enter__(self) -> UBatchContext:
        try:
            self._outer = enter_ubatch(self)
        except RuntimeError as error:
            self._finish_after_error(error)
            raise
        try:
            self._group.wait_for_baton(self.id, "to start")
            if self.streams is not None:
                self.streams.enter()
                self.streams.wait_after_yield(self._group.handed_event)
        except BaseException as error:
            restore_forward_context(self._outer)
            self._finish_after_error(error)
            raise
        return self

    def _record_hand_over(self) -> None:
        """CUDA: record this ubatch's enqueued work for the next owner (call with the lock held)."""
        if self.streams is not None:
            self._group.handed_event = self.streams.record_before_yield()

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is None:
                self.maybe_run_recv_hook()
        except BaseException as error:
            exc = error
            raise
        finally:
            restore_forward_context(self._outer)
            if exc is None:
                with self._group.lock:
                    self._group.finished[self.id] = True
                    self._record_hand_over()
                    self._group.hand_on(self.id)
            else:
                self._finish_after_error(exc)
        return False

    def _finish_after_error(self, error: BaseException) -> None:
        with self._group.lock:
            self._group.finished[self.id] = True
            # an UBatchAborted only echoes the error that already aborted the group
            if not isinstance(error, UBatchAborted):
                self._group.abort(error)

    def abort(self, error: BaseException) -> None:
        """Mark the whole group failed with ``error`` and wake every waiting ubatch (idempotent;
        the first error wins). For failures outside a context, e.g. in a thread's setup."""
        with self._group.lock:
            self._group.abort(error)

    @property
    def error(self) -> BaseException | None:
        """The first error that aborted the group, if any."""
        return self._group.error

    def yield_(self) -> None:
        """Hand the baton to the next unfinished ubatch and wait until it comes back."""
        group = self._group
        with group.lock:
            group.raise_if_aborted(self.id)
            self._record_hand_over()
            if group.hand_on(self.id) == self.id:
                return  # every other ubatch has finished: nobody to wait for
        group.wait_for_baton(self.id, "at a dbo_yield")
        if self.streams is not None:
            self.streams.wait_after_yield(group.handed_event)

    def register_recv_hook(self, hook: Callable[[], None]) -> None:
        """Give ``hook`` to the ubatch that runs last before this one gets the baton back: the
        previous unfinished one in the ring (this one if all others have finished)."""
        group = self._group
        with group.lock:
            group.hooks[group.previous_unfinished(self.id)].append(hook)

    def maybe_run_recv_hook(self) -> None:
        """Run and clear this ubatch's pending hooks, oldest first (outside the lock)."""
        group = self._group
        with group.lock:
            hooks = group.hooks[self.id]
            if not hooks:
                return
            group.hooks[self.id] = []
        for hook in hooks:
            hook()


def make_ubatch_contexts(
    num_ubatches: int = 2,
    *,
    timeout_s: float,
    streams: Sequence[UBatchStreams] | None = None,
) -> list[UBatchContext]:
    """Make the contexts of one step, sharing one protocol state; ubatch 0 holds the baton first.

    ``streams``: one ``UBatchStreams`` per ubatch (``dbo.cuda_streams.make_ubatch_streams``;
    the platform makes them where ops are asynchronous), or None.

    Raises:
        ValueError: if ``num_ubatches < 1``, ``timeout_s <= 0`` or ``streams`` has not one entry
            per ubatch.
    """
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if streams is not None and len(streams) != num_ubatches:
        raise ValueError(f"{len(streams)} stream sets for {num_ubatches} ubatches")
    group = UBatchGroup(num_ubatches, float(timeout_s))
    per_ubatch = [None] * num_ubatches if streams is None else list(streams)
    return [UBatchContext(i, group, per_ubatch[i]) for i in range(num_ubatches)]


def _current() -> UBatchContext | None:
    context = current_forward_context()
    return None if context is None else context.ubatch


def dbo_enabled() -> bool:
    """Whether a ubatch context is current in this thread."""
    return _current() is not None


def dbo_current_ubatch_id() -> int:
    """The current ubatch's id; 0 when DBO is off."""
    ctx = _current()
    return 0 if ctx is None else ctx.id


def dbo_yield() -> None:
    """Pass the baton to the next ubatch and wait to get it back (no-op when DBO is off).

    Raises:
        TimeoutError: if the baton does not come back within the contexts' timeout.
        UBatchAborted: if another ubatch failed.
    """
    ctx = _current()
    if ctx is not None:
        ctx.yield_()


def dbo_switch_to_comm() -> None:
    """CUDA: continue the current ubatch on its comm stream, after its enqueued compute work (vLLM's
    ``dbo_switch_to_comm``). No-op on CPU or when DBO is off."""
    ctx = _current()
    if ctx is not None and ctx.streams is not None:
        ctx.streams.switch_to(ctx.streams.comm_stream)


def dbo_switch_to_compute() -> None:
    """CUDA: continue the current ubatch on the compute stream, after its enqueued communication.
    No-op on CPU or when DBO is off."""
    ctx = _current()
    if ctx is not None and ctx.streams is not None:
        ctx.streams.switch_to(ctx.streams.compute_stream)


def dbo_register_recv_hook(hook: Callable[[], None]) -> None:
    """Give ``hook`` (typically a collective's ``wait``) to the ubatch that runs last before the
    baton comes back to this one (the previous unfinished one in the ring; with two ubatches the
    other one), which runs it at its next ``dbo_maybe_run_recv_hook()`` or when it leaves its
    context (no-op when DBO is off)."""
    ctx = _current()
    if ctx is not None:
        ctx.register_recv_hook(hook)


def dbo_maybe_run_recv_hook() -> None:
    """Run and clear the CURRENT ubatch's pending recv hooks, if any (no-op when DBO is off)."""
    ctx = _current()
    if ctx is not None:
        ctx.maybe_run_recv_hook()
