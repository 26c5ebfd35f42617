"""The hand-over between rank 0's HTTP thread (asyncio) and its engine loop (main thread).

The HTTP handlers ``submit`` requests and read their outputs from an ``asyncio.Queue``; the engine
loop ``take`` s new requests and aborts (blocking with a timeout only when every DP rank is idle)
and ``deliver`` s outputs, which are put on the handler's queue through the event loop
(``call_soon_threadsafe``). Every accepted request ends with exactly one output that has a
``finish_reason`` or an ``error``: ``fail_all`` ends whatever is still open when the engine stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass

from launch.engine.request import SamplingParams
from launch.engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequest:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """Tokens generated for a request since its previous output.

    ``finish_reason`` ("stop", "length" or "abort") is set on a request's last output; ``error``
    on the last output of a request that failed (``ServerShuttingDown``: the HTTP answer is 503;
    any other exception: 500; its text is the message).
    """

    request_id: int
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token if the request asked
    finish_reason: str | None = None
    error: Exception | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOrder:
    """``POST /start_profile`` or ``/stop_profile``: every rank starts or stops its profiler."""

    action: str  # "start" | "stop"
    done: asyncio.Future  # on the HTTP loop: None once every rank applied it, or the error


class ServerShuttingDown(RuntimeError):
    """``submit`` after ``stop_accepting``, or a request failed at shutdown: the server answers
    503."""


class EngineBridge:
    """Thread-safe request/output hand-over; ``loop`` is the HTTP thread's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # int: an abort; ProfileOrder: kept aside by take for take_profile_orders
        self._incoming: queue.Queue[NewRequest | int | ProfileOrder] = queue.Queue()
        self._profile_orders: list[ProfileOrder] = []
        self._outputs: dict[int, asyncio.Queue[RequestOutput]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._accepting = True
        self._last_take = time.monotonic()  # the engine loop's heartbeat: it takes every iteration
        self._num_running = 0  # requests running on any DP rank, as of the last report

    # HTTP thread (event loop) side

    def submit(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        outputs: asyncio.Queue[RequestOutput] | None = None,
    ) -> tuple[int, asyncio.Queue[RequestOutput]]:
        """Queue a request for the engine; its id and the queue its outputs arrive on
        (``outputs`` if given: several requests may share one, e.g. the ``n`` choices).

        Raises:
            ServerShuttingDown: once the server stopped accepting requests.
        """
        outputs = asyncio.Queue() if outputs is None else outputs
        with self._lock:  # with stop_accepting: a request is either refused or tracked
            if not self._accepting:
                raise ServerShuttingDown("the server is shutting down and accepts no new requests")
            request_id = next(self._ids)
            self._outputs[request_id] = outputs
        self._incoming.put(
            NewRequest(
                request_id=request_id,
                prompt_token_ids=tuple(prompt_token_ids),
                sampling_params=sampling_params,
            )
        )
        return request_id, outputs

    def abort(self, request_id: int) -> None:
        """Stop generating for a request (client gone, or a stop string matched)."""
        with self._lock:
            if self._outputs.pop(request_id, None) is None:
                return
        self._incoming.put(request_id)

    def profile(self, action: str) -> asyncio.Future:
        """Queue a profiler order (``action`` "start" or "stop") for every rank; the future
        resolves once every rank applied it (the first rank's error if one failed).

        Raises:
            ServerShuttingDown: once the server stopped accepting requests.
        """
        done = self._loop.create_future()
        with self._lock:
            if not self._accepting:
                raise ServerShuttingDown("the server is shutting down")
        self._incoming.put(ProfileOrder(action=action, done=done))
        return done

    # engine loop side

    @property
    def is_accepting(self) -> bool:
        return self._accepting

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._outputs)

    @property
    def num_queued(self) -> int:
        """Accepted requests not running yet (in hand-over or a scheduler's waiting queue), as of
        the engine loop's last report."""
        return max(self.num_in_flight - self._num_running, 0)

    @property
    def seconds_since_take(self) -> float:
        """Seconds since the engine loop last called ``take`` (it does every iteration, idle or
        not): how long it has been stuck in a step or a collective."""
        return time.monotonic() - self._last_take

    def note_running(self, num_running: int) -> None:
        """Engine loop: requests running over every DP rank after the last step."""
        self._num_running = num_running

    def take(self, timeout_s: float) -> tuple[list[NewRequest], list[int]]:
        """New requests and aborted request ids since the last call.

        Blocks up to ``timeout_s`` seconds for the first item when nothing is queued (0: never).
        """
        items = []
        if timeout_s > 0:
            try:
                items.append(self._incoming.get(timeout=timeout_s))  # blocking wait, timeout_s
            except queue.Empty:
                self._last_take = time.monotonic()
                return [], []
        while True:
            try:
                items.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        self._last_take = time.monotonic()
        new = [item for item in items if isinstance(item, NewRequest)]
        aborts = [item for item in items if isinstance(item, int)]
        self._profile_orders += [item for item in items if isinstance(item, ProfileOrder)]
        return new, aborts

    def take_profile_orders(self) -> list[ProfileOrder]:
        """The profiler orders ``take`` met since the last call, in order."""
        orders, self._profile_orders = self._profile_orders, []
        return orders

    def finish_profile_order(self, order: ProfileOrder, error: Exception | None) -> None:
        """Resolve ``order``'s future on the HTTP loop: done, or failed with ``error``."""

        def finish() -> None:
            if order.done.done():
                return
            if error is None:
                order.done.set_result(None)
            else:
                order.done.set_exception(error)

        with contextlib.suppress(RuntimeError):  # a closed event loop: the HTTP server is gone
            self._loop.call_soon_threadsafe(finish)

    def deliver(self, output: RequestOutput) -> None:
        """Pass an output to its request's handler; a request's last output closes it."""
        with self._lock:
            outputs = self._outputs.get(output.request_id)
            if outputs is not None and output.is_last:
                del self._outputs[output.request_id]
        if outputs is None:
            return  # aborted by the handler: nobody is listening
        with contextlib.suppress(RuntimeError):  # a closed event loop: the HTTP server is gone
            self._loop.call_soon_threadsafe(outputs.put_nowait, output)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def fail_all(self, error: Exception) -> int:
        """End every open request and profiler order with ``error``; how many requests there
        were."""
        with self._lock:
            open_ids = list(self._outputs)
        for request_id in open_ids:
            self.deliver(RequestOutput(request_id=request_id, error=error))
        self.take(0)  # profiler orders still in the hand-over
        for order in self.take_profile_orders():
            self.finish_profile_order(order, error)
        return len(open_ids)
