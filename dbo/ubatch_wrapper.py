"""Run a model on ubatch slices in ping-pong threads (vLLM's ``UBatchWrapper``, CPU-thread part).

Without slices the wrapper just calls the model. With slices it starts one thread per ubatch, each
inside its ``UBatchContext`` and the scope the caller gave for that ubatch (the model runner's
per-ubatch forward context: its slice of the attention metadata and its DP token counts), lets
ubatch 0 go first (it holds the baton), joins, and concatenates the outputs in ubatch order. A
failure in any ubatch aborts the others and is re-raised once, as the original exception, in the
caller. The wrapper knows nothing of the model's per-ubatch state beyond entering those scopes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from dbo.ubatch_context import UBatchContext, make_ubatch_contexts
from dbo.ubatch_slicing import UBatchSlice

ModelFn = Callable[[Tensor, Tensor], Tensor]

# how often the caller's thread checks that the ubatch threads still make progress
_WATCHDOG_POLL_S = 0.1
# The watchdog is a backstop for a ubatch stuck outside any wait (e.g. in model code). It fires
# this much after timeout_s, so a stuck baton wait reports its own, more specific TimeoutError.
_WATCHDOG_GRACE_S = 1.0


class UBatchWrapper:
    """Wraps ``model_fn(input_ids, positions) -> Tensor [num_tokens, ...]``.

    Args:
        model_fn: the model's forward; with DBO it calls the ``dbo_*`` functions at its yield
            points. Its output's dim 0 must be the token dim (one row per input token).
        timeout_s: bound on every baton wait; a ubatch thread that runs without handing on the
            baton for longer (plus a grace of up to 1 s) fails the step with ``TimeoutError``.
        make_streams: ``(num_ubatches, device) -> list of UBatchStreams or None``: each ubatch's
            comm stream and events on the inputs' device (the platform's ``make_ubatch_streams``,
            ``dbo.cuda_streams`` on CUDA); None: no streams (ops run in issue order).
    """

    def __init__(
        self,
        model_fn: ModelFn,
        *,
        timeout_s: float = 300.0,
        make_streams: Callable[[int, torch.device], list | None] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.model_fn = model_fn
        self.timeout_s = float(timeout_s)
        self.make_streams = make_streams

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ubatch_slices: Sequence[UBatchSlice] | None = None,
        *,
        ubatch_scopes: Sequence[AbstractContextManager[object]] | None = None,
    ) -> Tensor:
        """Run the model, on ubatch threads when ``ubatch_slices`` is given.

        Args:
            input_ids: ``[num_tokens]`` int64 (padding rows included).
            positions: ``[num_tokens]`` int64.
            ubatch_slices: from ``make_ubatch_slices``; ``None`` or empty runs without DBO, in the
                caller's thread.
            ubatch_scopes: one context manager per ubatch, entered in that ubatch's thread inside
                its ``UBatchContext`` around ``model_fn`` (the model runner's
                ``set_forward_context`` of the ubatch); None: no scope.

        Returns:
            ``model_fn``'s outputs of all ubatches concatenated along dim 0, in ubatch order.

        Raises:
            ValueError: if ``ubatch_scopes`` does not have one entry per ubatch.
            The first exception raised in a ubatch thread (its original type, once);
            ``TimeoutError`` if a ubatch thread makes no progress for ``timeout_s`` plus the grace.
        """
        if not ubatch_slices:
            return self.model_fn(input_ids, positions)
        if ubatch_scopes is None:
            ubatch_scopes = [contextlib.nullcontext() for _ in ubatch_slices]
        if len(ubatch_scopes) != len(ubatch_slices):
            raise ValueError(
                f"{len(ubatch_scopes)} ubatch_scopes for {len(ubatch_slices)} ubatch_slices"
            )
        streams = None
        if self.make_streams is not None:
            streams = self.make_streams(len(ubatch_slices), input_ids.device)
        contexts = make_ubatch_contexts(
            len(ubatch_slices), timeout_s=self.timeout_s, streams=streams
        )
        outputs: list[Tensor | None] = [None] * len(contexts)
        start_barrier = threading.Barrier(len(contexts) + 1)
        threads = [
            threading.Thread(
                target=self._run_ubatch,
                args=(ctx, scope, start_barrier, (input_ids[rows], positions[rows]), outputs),
                name=f"ubatch{ctx.id}",
                daemon=True,  # a thread stuck in model code must not keep the process alive
            )
            for ctx, rows, scope in zip(
                contexts, (s.token_slice for s in ubatch_slices), ubatch_scopes, strict=True
            )
        ]
        self._start_and_join(threads, start_barrier, contexts)
        error = contexts[0].error
        if error is not None:
            raise error
        return torch.cat(outputs, dim=0)

    def _run_ubatch(
        self,
        ctx: UBatchContext,
        scope: AbstractContextManager[object],
        start_barrier: threading.Barrier,
        args: tuple[Tensor, Tensor],
        outputs: list[Tensor | None],
    ) -> None:
        try:
            start_barrier.wait(self.timeout_s)  # blocking wait (timeout self.timeout_s)
            with ctx, scope:
                outputs[ctx.id] = self.model_fn(*args)
        except threading.BrokenBarrierError:
            ctx.abort(TimeoutError(f"ubatch threads did not all start within {self.timeout_s:g} s"))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            ctx.abort(error)  # no-op when the context already aborted the group with it

    def _start_and_join(
        self,
        threads: list[threading.Thread],
        start_barrier: threading.Barrier,
        contexts: list[UBatchContext],
    ) -> None:
        """Start the ubatch threads, release them together (ubatch 0 holds the baton) and wait
        for them."""
        for thread in threads:
            thread.start()
        try:
            start_barrier.wait(self.timeout_s)  # blocking wait (timeout self.timeout_s)
        except threading.BrokenBarrierError:
            contexts[0].abort(
                TimeoutError(f"ubatch threads did not all start within {self.timeout_s:g} s")
            )
        self._join(threads, contexts)

    def _join(self, threads: list[threading.Thread], contexts: list[UBatchContext]) -> None:
        """Wait for the threads; give up on ones that make no progress for ``timeout_s``."""
        timeout_ns = int((self.timeout_s + min(self.timeout_s, _WATCHDOG_GRACE_S)) * 1e9)
        poll_s = min(_WATCHDOG_POLL_S, self.timeout_s)
        while True:
            alive = [thread for thread in threads if thread.is_alive()]
            if not alive:
                return
            alive[0].join(poll_s)  # blocking wait (timeout poll_s, in a watchdog loop)
            if time.perf_counter_ns() - contexts[0].last_progress_ns > timeout_ns:
                stuck = [thread.name for thread in threads if thread.is_alive()]
                if stuck:
                    contexts[0].abort(
                        TimeoutError(
                            f"ubatch threads {stuck} made no progress (no baton pass) for "
                            f"{timeout_ns / 1e9:g} s"
                        )
                    )
                    return
