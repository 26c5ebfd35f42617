"""Run a model on ubatch slices in ping-pong threads (vLLM's ``UBatchWrapper``, CPU-thread part).

Without slices the wrapper just calls the model. With slices it splits the attention metadata,
starts one thread per ubatch, each inside its ``UBatchContext``, lets ubatch 0 go first (it holds
the baton), joins, and concatenates the outputs in ubatch order. A failure in any ubatch aborts the
others and is re-raised once, as the original exception, in the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dbo.attention_metadata import CommonAttentionMetadata
from dbo.ubatch_context import UBatchContext, make_ubatch_contexts, set_num_padded_tokens_across_dp
from dbo.ubatch_slicing import UBatchSlice, split_attn_metadata

ModelFn = Callable[[Tensor, Tensor, CommonAttentionMetadata], Tensor]

# how often the caller's thread checks that the ubatch threads still make progress
_WATCHDOG_POLL_S = 0.1
# The watchdog is a backstop for a ubatch stuck outside any wait (e.g. in model code). It fires
# this much after timeout_s, so a stuck baton wait reports its own, more specific TimeoutError.
_WATCHDOG_GRACE_S = 1.0


class UBatchWrapper:
    """Wraps ``model_fn(input_ids, positions, attn_metadata) -> Tensor [num_tokens, ...]``.

    Args:
        model_fn: the model's forward; with DBO it calls the ``dbo_*`` functions at its yield
            points. Its output's dim 0 must be the token dim (``attn_metadata.num_tokens`` rows).
        timeout_s: bound on every baton wait; a ubatch thread that runs without handing on the
            baton for longer (plus a grace of up to 1 s) fails the step with ``TimeoutError``.
        use_streams: give each ubatch a comm stream and events on the inputs' device
            (``dbo.cuda_streams``; the caller passes ``Platform.has_ubatch_streams``).
    """

    def __init__(
        self, model_fn: ModelFn, *, timeout_s: float = 300.0, use_streams: bool = False
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.model_fn = model_fn
        self.timeout_s = float(timeout_s)
        self.use_streams = use_streams

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn_metadata: CommonAttentionMetadata,
        ubatch_slices: Sequence[UBatchSlice] | None = None,
        *,
        num_padded_tokens_across_dp: Sequence[Sequence[int]] | None = None,
    ) -> Tensor:
        """Run the model, on ubatch threads when ``ubatch_slices`` is given.

        Args:
            input_ids: ``[num_tokens]`` int64 (padding rows included).
            positions: ``[num_tokens]`` int64.
            attn_metadata: metadata of the whole batch; sliced per ubatch here.
            ubatch_slices: from ``make_ubatch_slices``; ``None`` or empty runs without DBO.
            num_padded_tokens_across_dp: per ubatch, every DP rank's row count of it (known after the DP
                ranks agreed to pad to the same size); exposed as ``dbo_num_padded_tokens_across_dp()``.
                Without slices, one entry: every DP rank's row count of the whole batch.

        Returns:
            ``model_fn``'s outputs of all ubatches concatenated along dim 0, in ubatch order.

        Raises:
            The first exception raised in a ubatch thread (its original type, once);
            ``TimeoutError`` if a ubatch thread makes no progress for ``timeout_s`` plus the grace.
        """
        if not ubatch_slices:
            counts = num_padded_tokens_across_dp[0] if num_padded_tokens_across_dp else None
            with set_num_padded_tokens_across_dp(counts):
                return self.model_fn(input_ids, positions, attn_metadata)
        metadata = split_attn_metadata(ubatch_slices, attn_metadata)
        contexts = make_ubatch_contexts(
            len(ubatch_slices),
            timeout_s=self.timeout_s,
            num_padded_tokens_across_dp=num_padded_tokens_across_dp,
            stream_device=input_ids.device if self.use_streams else None,
        )
        outputs: list[Tensor | None] = [None] * len(contexts)
        start_barrier = threading.Barrier(len(contexts) + 1)
        threads = []
        for ctx, ubatch_slice, ubatch_metadata in zip(
            contexts, ubatch_slices, metadata, strict=True
        ):
            token_slice = ubatch_slice.token_slice
            args = (input_ids[token_slice], positions[token_slice], ubatch_metadata)
            threads.append(
                threading.Thread(
                    target=self._run_ubatch,
                    args=(ctx, start_barrier, args, outputs),
                    name=f"ubatch{ctx.id}",
                    daemon=True,  # a thread stuck in model code must not keep the process alive
                )
            )
        for thread in threads:
            thread.start()
        try:
            start_barrier.wait(self.timeout_s)  # blocking wait (timeout self.timeout_s)
        except threading.BrokenBarrierError:
            contexts[0].abort(
                TimeoutError(f"ubatch threads did not all start within {self.timeout_s:g} s")
            )
        self._join(threads, contexts)
        error = contexts[0].error
        if error is not None:
            raise error
        return torch.cat(outputs, dim=0)

    def _run_ubatch(
        self,
        ctx: UBatchContext,
        start_barrier: threading.Barrier,
        args: tuple[Tensor, Tensor, CommonAttentionMetadata],
        outputs: list[Tensor | None],
    ) -> None:
        try:
            start_barrier.wait(self.timeout_s)  # blocking wait (timeout self.timeout_s)
            with ctx:
                outputs[ctx.id] = self.model_fn(*args)
        except threading.BrokenBarrierError:
            ctx.abort(TimeoutError(f"ubatch threads did not all start within {self.timeout_s:g} s"))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            ctx.abort(error)  # no-op when the context already aborted the group with it

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
