"""Batches of a chosen size for the benchmark, fed through the engine's own scheduler.

``decode:T``: T requests per rank with short prompts are prefilled first; every measured step then
decodes one token of each, i.e. exactly T tokens per rank. ``prefill:T``: before each measured step
fresh requests whose prompts add up to T tokens are added (one token to generate each), so the step
prefills exactly T tokens per rank. Every rank builds the same shapes, so ranks stay in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from launch.engine.request import Request, SamplingParams

BATCH_KINDS = ("decode", "prefill")
DECODE_PROMPT_LEN = 8
MAX_PREFILL_PROMPT_LEN = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSpec:
    """One benchmarked batch shape: ``kind`` ("decode" or "prefill") and tokens per rank per step.

    Raises:
        ValueError: unknown kind or ``num_tokens_per_rank < 1``.
    """

    kind: str
    num_tokens_per_rank: int

    def __post_init__(self) -> None:
        if self.kind not in BATCH_KINDS:
            raise ValueError(f"batch kind {self.kind!r} is not one of {BATCH_KINDS}")
        if self.num_tokens_per_rank < 1:
            raise ValueError(f"tokens per rank must be >= 1, got {self.num_tokens_per_rank}")

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.num_tokens_per_rank}"


def parse_batches(text: str, flag: str = "--batches") -> list[BatchSpec]:
    """``"decode:16,prefill:1024"`` -> BatchSpecs (a bare number means ``decode:N``).

    Raises:
        ValueError: naming ``flag`` and the malformed entry.
    """
    specs = []
    for part in text.split(","):
        kind, sep, count = part.strip().rpartition(":")
        try:
            specs.append(BatchSpec(kind=kind if sep else "decode", num_tokens_per_rank=int(count)))
        except ValueError as e:
            raise ValueError(f"{flag} {text!r}: bad entry {part!r} ({e})") from None
    return specs


class Workload:
    """Keeps an engine's scheduler fed with batches of ``spec``'s shape.

    Args:
        engine: a ``launch.engine.LLMEngine`` whose scheduler limits admit ``spec``.
        spec: the batch shape.
        num_steps: measured steps to provide (decode requests generate exactly that many).
        vocab_size: prompt token ids are drawn from ``[3, vocab_size)``.
        seed: prompt ids (the same on every rank, which does not matter for timing).
    """

    def __init__(self, engine, spec: BatchSpec, *, num_steps: int, vocab_size: int, seed: int):
        self.engine = engine
        self.spec = spec
        self.num_steps = num_steps
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self._next_id = 0
        self._requests: list[Request] = []

    def _add(self, prompt_len: int, max_tokens: int) -> None:
        request = Request(
            request_id=self._next_id,
            prompt_token_ids=[self.rng.randrange(3, self.vocab_size) for _ in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=max_tokens),
        )
        self._next_id += 1
        self._requests.append(request)
        self.engine.add_request(request)

    def prepare(self) -> None:
        """Decode: add the requests and step (all ranks together) until all are prefilled."""
        if self.spec.kind != "decode":
            return
        for _ in range(self.spec.num_tokens_per_rank):
            # +1: the token sampled when the prefill completes
            self._add(DECODE_PROMPT_LEN, self.num_steps + 1)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self._requests):
            self.engine.step()

    def before_step(self) -> None:
        """Prefill: add fresh requests with ``num_tokens_per_rank`` prompt tokens in all."""
        if self.spec.kind != "prefill":
            return
        remaining = self.spec.num_tokens_per_rank
        while remaining > 0:
            prompt_len = min(remaining, MAX_PREFILL_PROMPT_LEN)
            self._add(prompt_len, 1)
            remaining -= prompt_len

    def drain(self) -> None:
        """Step until no rank has work left (every rank calls it)."""
        self.engine.run_until_done()

    @staticmethod
    def limits(specs: list[BatchSpec], num_steps: int) -> dict[str, int]:
        """Engine limits that admit every spec: max_num_seqs, max_num_batched_tokens,
        max_model_len."""
        max_tokens = max(s.num_tokens_per_rank for s in specs)
        max_seqs = max(
            s.num_tokens_per_rank
            if s.kind == "decode"
            else -(-s.num_tokens_per_rank // MAX_PREFILL_PROMPT_LEN)
            for s in specs
        )
        longest_prompt = max(
            DECODE_PROMPT_LEN
            if s.kind == "decode"
            else min(s.num_tokens_per_rank, MAX_PREFILL_PROMPT_LEN)
            for s in specs
        )
        return {
            "max_num_seqs": max_seqs,
            "max_num_batched_tokens": max_tokens,
            "max_model_len": max(longest_prompt + 1, DECODE_PROMPT_LEN + num_steps + 2) + 1,
        }
