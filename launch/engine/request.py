"""A generation request and its sampling parameters, as the scheduler tracks them."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from launch.engine.sampler import MAX_LOGPROBS, TokenLogprobs

# vLLM's rules (``vllm.sampling_params``): a temperature below this epsilon means greedy decoding
# (dividing logits by ~1e-38 or less overflows float32 and sampling would see inf/nan).
SAMPLING_EPS = 1e-5
# vLLM's protocol bounds a seed by torch.iinfo(torch.long); torch.Generator.manual_seed accepts
# [-2**63, 2**64), so every seed in this range is one the generator takes.
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1


def check_seed(seed: int | None, name: str = "seed") -> None:
    """Raise ValueError unless ``seed`` is None or an int in [MIN_SEED, MAX_SEED]."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"{name} must be an integer, got {seed!r}")
    if not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be in [-2**63, 2**63 - 1] (a 64-bit signed int), got {seed}")


def check_temperature(temperature: float, name: str = "temperature") -> None:
    """Raise ValueError unless ``temperature`` is a finite number >= 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"{name} must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"{name} must be a finite number >= 0 (below {SAMPLING_EPS:g} means greedy), "
            f"got {temperature}"
        )


def offset_seed(seed: int, offset: int) -> int:
    """``seed + offset`` wrapped into [MIN_SEED, MAX_SEED]: the seed of prompt ``offset`` of an
    offline run, or of choice ``offset`` of an ``n``-choice request (different yet reproducible)."""
    return (seed + offset - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _as_tuple(name: str, value, kind: type, what: str) -> tuple:
    """``value`` (one item or a list/tuple of items of ``kind``) as a tuple; ValueError if not."""
    items = (value,) if isinstance(value, kind) else value
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(v, kind) and not isinstance(v, bool) for v in items
    ):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return tuple(items)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token: vLLM's ``SamplingParams`` (``vllm/sampling_params.py``), the
    fields this engine implements, with vLLM's names and rules. The offline API
    (``launch.SamplingParams``), the HTTP server and the engine share this one class.

    A temperature below ``SAMPLING_EPS`` (1e-5) means greedy (argmax), as in vLLM. Unlike vLLM,
    whose default temperature is 1.0, the default here is 0.0 (greedy): pass ``temperature`` to
    sample. ``n`` and ``stop`` (strings) are applied by the front ends (``launch.LLM``, the
    server), which run ``n`` engine requests and cut the text at the first stop string; the engine
    itself generates one sequence per request and stops at ``stop_token_ids`` / eos.

    ``stop`` and ``stop_token_ids`` accept one item or a list, and are kept as tuples.

    Raises:
        ValueError: naming the field and the accepted values, if ``n`` or ``max_tokens`` is not
            an int >= 1, ``temperature`` is not a finite number >= 0, ``seed`` is outside
            [-2**63, 2**63 - 1], ``top_p`` outside (0, 1], ``logprobs`` outside [0, 20],
            ``stop`` not non-empty strings or ``stop_token_ids`` not ints.
        TypeError: an unknown field (Python names it).
    """

    n: int = 1  # sequences per prompt (front ends: n engine requests, seeds seed + i)
    max_tokens: int = 16
    temperature: float = 0.0  # below SAMPLING_EPS means greedy (argmax)
    top_p: float = 1.0  # nucleus sampling: keep the most likely tokens holding this much mass
    seed: int | None = None  # per-request generator seed when sampling
    stop: tuple[str, ...] = ()  # the text ends before the first of these (front ends)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep generating past the model's eos token (benchmarks)
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        check_temperature(self.temperature)
        check_seed(self.seed)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        stop = _as_tuple("stop", self.stop, str, "a string or a list of strings")
        if not all(stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        stop_ids = _as_tuple("stop_token_ids", self.stop_token_ids, int, "a list of token ids")
        object.__setattr__(self, "stop", stop)  # frozen: keep the normalised tuples
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


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
    finish_reason: str | None = None  # "length", "stop", "abort" or "error" once finished
    error: str | None = None  # why the request failed (finish_reason "error"): its own data only
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
