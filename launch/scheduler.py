"""Per-DP-rank scheduler: which requests run this step, and how many tokens each.

Running requests go first (a decode computes one token, an unfinished prompt its next chunk), then
waiting requests are admitted while ``max_num_seqs`` and the token budget
``max_num_batched_tokens`` allow; a prompt longer than the remaining budget is chunked (chunked
prefill, as vLLM's scheduler does). A request is admitted only when the KV cache can hold its whole
prompt plus ``max_tokens`` (capped at ``max_model_len``), so a running request never runs out of
blocks and nothing is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from launch.kv_cache_manager import KVCacheManager
from launch.request import Request, RequestStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        """True if every scheduled request is past its prompt (vLLM's decode-only batch)."""
        return all(
            s.request.num_computed_tokens >= s.request.num_prompt_tokens for s in self.scheduled
        )


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
        for request in self.running:
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            scheduled.append(ScheduledRequest(request=request, num_new_tokens=num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self.kv_cache_manager.allocate(request.request_id, self._max_len(request)):
                break  # wait until a running request frees its blocks
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            scheduled.append(ScheduledRequest(request=request, num_new_tokens=num_new))
            budget -= num_new
        return SchedulerOutput(scheduled=tuple(scheduled))

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[int, int]
    ) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens; return the requests that finished.

        ``sampled_token_ids`` maps request_id to the token sampled for every request whose known
        tokens were all computed this step (a finished prompt or a decode); KeyError if one is missing.
        """
        finished: list[Request] = []
        for item in scheduler_output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk: nothing sampled yet
            token = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                request.status = RequestStatus.FINISHED
                request.finish_reason = reason
                self.running.remove(request)
                self.kv_cache_manager.free(request.request_id)
                finished.append(request)
        return finished

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if token in self.eos_token_ids or token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None
