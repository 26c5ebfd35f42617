"""Per-DP-rank scheduler (``Scheduler``): which requests run this step and how many tokens each,
with chunked prefill and vLLM's recompute preemption when KV blocks run out.
docs/serving.md#scheduler-chunked-prefill-recompute-preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on

    @property
    def is_decode(self) -> bool:
        """One token past the prompt (vLLM's decode); a prompt chunk, or a preempted request
        recomputing its generated tokens, is a prefill."""
        return self.num_new_tokens == 1 and (
            self.request.num_computed_tokens >= self.request.num_prompt_tokens
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()  # running requests sent back to waiting in this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        """True if every scheduled request computes one token past its prompt (vLLM's decode-only
        batch); a preempted request recomputing its generated tokens counts as a prefill."""
        return all(s.is_decode for s in self.scheduled)


class Scheduler:
    """Continuous batching with chunked prefill for one DP rank.

    Raises:
        ValueError: from ``add_request`` if the prompt is empty or does not fit ``max_model_len``,
            or the KV cache could never hold the request.
    """

    def __init__(
        self,
        *,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {num_prompt} tokens leaves no room to "
                f"generate within --max-model-len {self.max_model_len}"
            )
        needed = self.kv_cache_manager.num_blocks_for(self._max_len(request))
        if needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {needed} KV blocks but the cache has "
                f"{self.kv_cache_manager.num_blocks}"
            )
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _max_len(self, request: Request) -> int:
        return min(
            request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len
        )

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, num_new, preempted):
                break  # ``request`` itself was preempted: every later one already was
            scheduled.append(ScheduledRequest(request=request, num_new_tokens=num_new))
            budget -= num_new
            index += 1
        while (
            self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted
        ):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate(request, num_new):
                break  # wait until a running request frees its blocks
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request=request, num_new_tokens=num_new))
            budget -= num_new
        return SchedulerOutput(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def _make_room(self, request: Request, num_new_tokens: int, preempted: list[Request]) -> bool:
        """Allocate ``request``'s blocks for this step, preempting the most recently admitted
        running requests (the tail of ``running``, not yet scheduled) until they fit.

        Returns False if ``request`` had to be preempted itself (it was the tail).
        """
        while not self._allocate(request, num_new_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request``'s blocks to hold its tokens through this step; False if short."""
        return self.kv_cache_manager.allocate(
            request.request_id, request.num_computed_tokens + num_new_tokens
        )

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and queue it first for recomputation (vLLM's recompute)."""
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def abort_request(self, request_id: int) -> Request | None:
        """Drop a waiting/running request and free its blocks; returns it, or None if unknown."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.kv_cache_manager.free(request_id)
                    request.status = RequestStatus.FINISHED
                    request.finish_reason = "abort"
                    return request
        return None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[int, int],
        failed_request_ids: dict[int, str] | None = None,
    ) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens; return the requests that finished.

        ``sampled_token_ids`` maps request_id to the token sampled for every request whose known
        tokens were all computed this step (a finished prompt or a decode), except those in
        ``failed_request_ids`` (request_id -> error), which finish with ``finish_reason`` "error";
        KeyError if a request is in neither.
        """
        failed_request_ids = failed_request_ids or {}
        finished: list[Request] = []
        for item in scheduler_output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk: nothing sampled yet
            error = failed_request_ids.get(request.request_id)
            if error is not None:
                request.error = error
                self._finish(request, "error")
                finished.append(request)
                continue
            token = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.running.remove(request)
        self.kv_cache_manager.free(request.request_id)

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if token in params.stop_token_ids or (
            token in self.eos_token_ids and not params.ignore_eos
        ):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None
