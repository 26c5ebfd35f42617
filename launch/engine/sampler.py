"""Sampling: the next token of every sampled row in a few batched ops, nucleus (top-p)
filtering, and logprobs of sampled tokens.

Greedy rows (temperature 0) take one ``argmax`` over the batch. Rows with a temperature use the
Gumbel-max trick (Gumbel 1954; e.g. Maddison et al. 2014, "A* sampling"): ``argmax(logits / T + g)``
with ``g = -log(-log(u))`` and ``u`` uniform draws a token with probability ``softmax(logits / T)``;
tokens outside a row's top-p nucleus get score ``-inf`` first, which samples from the renormalised
nucleus (vLLM's ``apply_top_k_top_p`` semantics).

The uniforms are not drawn from a stateful generator but computed by a counter-based hash of
(request seed, output position, vocab index) in torch integer ops — the idea of counter-based RNGs
(Salmon et al., SC 2011 "Parallel random numbers: as easy as 1, 2, 3"); the mixer is Chris
Wellons' ``lowbias32`` (https://nullprogram.com/blog/2018/07/31/). So a request with a given seed
samples the same token at the same output position from the same logits whatever batch, step or
rank it runs in, and after a preemption's recompute; no per-request generator state is kept.

Logprobs are vLLM's default "raw logprobs": ``log_softmax`` of the model's logits before
temperature or top-p, for the sampled token and the ``num_top`` most likely tokens of its row. They
are computed only for the rows of requests that asked for them (no cost otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (and OpenAI's top_logprobs limit)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprobs:
    """The logprob of one sampled token and the ``num_top`` most likely tokens at its position.

    ``top_token_ids`` / ``top_logprobs`` are sorted by descending logprob (ties: lower id first,
    as ``torch.topk`` returns them); empty when ``num_top`` is 0.
    """

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def apply_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus: the smallest set of most likely tokens whose
    probability mass reaches ``top_p`` (Holtzman et al., ICLR 2020; vLLM's ``apply_top_k_top_p``).

    Args:
        probs: ``[vocab_size]`` float32, non-negative, summing to 1.
        top_p: in (0, 1]; 1 returns ``probs`` unchanged.

    Returns:
        ``[vocab_size]`` float32, not renormalised (``torch.multinomial`` does not need it). The
        most likely token is always kept.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    outside = mass_before >= top_p
    outside[..., 0] = False  # the most likely token, whatever rounding did to top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """Raw logprobs of the sampled tokens and of each row's ``num_top[i]`` most likely tokens.

    Args:
        logits: ``[num_rows, vocab_size]`` float32 or float64 (bfloat16 is computed in float32).
        token_ids: ``[num_rows]`` int64, the token sampled in each row.
        num_top: per row, in [0, MAX_LOGPROBS].

    Returns:
        One ``TokenLogprobs`` per row.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 models stay float64
    logprobs = torch.log_softmax(logits.to(dtype), dim=-1)
    sampled = logprobs.gather(-1, token_ids.view(-1, 1)).view(-1).tolist()
    k = max(num_top, default=0)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k else (None, None)
    values = top_values.tolist() if k else None
    ids = top_ids.tolist() if k else None
    return [
        TokenLogprobs(
            token_id=int(token_ids[i]),
            logprob=sampled[i],
            top_token_ids=tuple(ids[i][: num_top[i]]) if k else (),
            top_logprobs=tuple(values[i][: num_top[i]]) if k else (),
        )
        for i in range(len(num_top))
    ]


_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (c split in 16-bit
    halves: each partial product stays below 2**48)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: Tensor) -> Tensor:
    """lowbias32: a bijective 32-bit integer mixer. x: int64 values in [0, 2**32) -> same range."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Uniforms in (0, 1), float64, ``[num_rows, vocab_size]``: a pure function of (seed,
    position, vocab index). seeds: [num_rows] int64 (any value; 64 bits used); positions:
    [num_rows] int64 >= 0."""
    seeds = seeds.to(torch.int64)
    key = mix32(seeds & _MASK32)
    key = mix32(key ^ ((seeds >> 32) & _MASK32))
    key = mix32(key ^ (positions.to(torch.int64) & _MASK32))
    vocab = mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) ^ 0x9E3779B9)
    bits = mix32(key[:, None] ^ vocab[None, :])
    bits = mix32(bits ^ key[:, None])  # a second round: key and vocab index fully mixed
    return (bits.to(torch.float64) + 0.5) * 2.0**-32


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingMetadata:
    """Per sampled row: how to pick its token.

    Fields:
        temperature: [num_rows] float32, 0 = greedy.
        top_p: [num_rows] float64 (float32 accepted) in (0, 1]; 1 = no nucleus filtering
            (ignored for greedy rows).
        seeds: [num_rows] int64, the request's seed (used only where temperature > 0).
        output_positions: [num_rows] int64, index of the token being sampled among the request's
            output tokens (0 for the first generated token).
        num_logprobs: [num_rows] int64, top logprobs the request asked for; -1 = no logprobs.
        is_all_greedy: True if every temperature is 0 (skips the random path).
    """

    temperature: Tensor
    top_p: Tensor
    seeds: Tensor
    output_positions: Tensor
    num_logprobs: Tensor
    is_all_greedy: bool

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of ``rows`` only (in that order)."""
        temperature = self.temperature[rows]
        return SamplingMetadata(
            temperature=temperature,
            top_p=self.top_p[rows],
            seeds=self.seeds[rows],
            output_positions=self.output_positions[rows],
            num_logprobs=self.num_logprobs[rows],
            is_all_greedy=bool((temperature == 0).all()),
        )


def top_p_mask(scores: Tensor, top_p: Tensor) -> Tensor:
    """Rows of ``scores`` [num_rows, vocab_size] with every token outside the row's top-p nucleus
    (of ``softmax(scores)``; see ``apply_top_p``) set to ``-inf``; the most likely token is always
    kept, even for a ``top_p`` that rounded to 0. top_p: [num_rows] float32 or float64."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # top_p 1 keeps every token (no rounding of the cumulative sum can drop one)
    threshold = torch.where(top_p >= 1, float("inf"), top_p.to(mass_before.dtype))
    outside_sorted = mass_before >= threshold[:, None]
    outside_sorted[:, 0] = False  # the most likely token is always kept (top_p 0 would drop it)
    outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
    return scores.masked_fill(outside, float("-inf"))


class Sampler:
    """logits [num_rows, vocab_size] (float32) + SamplingMetadata -> token ids [num_rows] int64."""

    def __call__(self, logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        # max's indices are argmax's (the first maximal value per row, as documented for both;
        # NaN counts as maximal in both), in less time than argmax (docs/hardware.md, "Other ops")
        tokens = logits.max(dim=-1).indices
        if metadata.is_all_greedy:
            return tokens
        random_rows = (metadata.temperature > 0).nonzero().flatten()
        temperature = metadata.temperature[random_rows].to(torch.float64)
        scores = logits[random_rows].to(torch.float64) / temperature[:, None]
        top_p = metadata.top_p[random_rows]
        if bool((top_p < 1).any()):
            scores = top_p_mask(scores, top_p)
        uniform = hash_uniform(
            metadata.seeds[random_rows], metadata.output_positions[random_rows], logits.shape[-1]
        )
        tokens[random_rows] = (scores - torch.log(-torch.log(uniform))).argmax(dim=-1)
        return tokens
