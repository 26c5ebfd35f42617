"""A generation request and its sampling parameters, as the scheduler tracks them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from launch.engine.sampler import MAX_LOGPROBS, TokenLogprobs


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token.

    Raises:
        ValueError: if ``max_tokens`` < 1, ``temperature`` < 0, ``top_p`` outside (0, 1] or
            ``logprobs`` outside [0, 20].
    """

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy (argmax)
    seed: int | None = None  # per-request generator seed when sampling
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep generating past the model's eos token (benchmarks)
    top_p: float = 1.0  # nucleus sampling: keep the most likely tokens holding this much mass
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, kw_only=True)
class Request:
    """One prompt being generated on this DP rank.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the tokens from there to
    ``num_tokens`` are what the next steps must compute (a prompt chunk, or the last sampled token).
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(
        default_factory=list
    )  # if sampling_params.logprobs
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "length", "stop" or "abort" once finished
    num_preemptions: int = 0  # times its KV was freed to be recomputed later

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        offset = len(prompt)
        return prompt[start:] + self.output_token_ids[max(start - offset, 0) : stop - offset]
