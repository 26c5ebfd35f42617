"""Sampling (``Sampler``): the next token of every sampled row in a few batched ops (greedy argmax,
or Gumbel-max over seeded counter-based noise), nucleus (top-p) filtering, and logprobs of sampled
tokens. Why a seeded request samples alike in any batch:
docs/models.md#sampler-gumbel-max-over-counter-based-noise."""

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


def logprob_values(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> Tensor:
    """Raw logprobs of the sampled tokens and of each row's ``num_top[i]`` most likely tokens, on
    the logits' device and packed for one read with the step's other results (``unpack_logprobs``).

    Args:
        logits: ``[num_rows, vocab_size]`` float32 or float64 (bfloat16 is computed in float32).
        token_ids: ``[num_rows]`` int64, the token sampled in each row.
        num_top: per row, in [0, MAX_LOGPROBS] (host ints: they size the result).

    Returns:
        ``[num_rows, 1 + 2 * max(num_top)]`` float64: per row the sampled token's logprob, the top
        logprobs (descending; ties: lower id first, as ``torch.topk``), then their token ids
        (exact in float64: ids are far below 2**53).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 models stay float64
    logprobs = torch.log_softmax(logits.to(dtype), dim=-1)
    sampled = logprobs.gather(-1, token_ids.view(-1, 1))
    k = max(num_top, default=0)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)
    return torch.cat([sampled, top_values, top_ids.to(dtype)], dim=1).to(torch.float64)


def unpack_logprobs(
    values: list[float], token_ids: list[int], num_top: list[int]
) -> list[TokenLogprobs]:
    """One ``TokenLogprobs`` per row from ``logprob_values(...)`` read to the host and flattened
    (``values``), the rows' sampled ``token_ids`` and their ``num_top``."""
    k = max(num_top, default=0)
    width = 1 + 2 * k
    rows = [values[i * width : (i + 1) * width] for i in range(len(num_top))]
    return [
        TokenLogprobs(
            token_id=token_id,
            logprob=row[0],
            top_token_ids=tuple(int(t) for t in row[1 + k : 1 + k + n]),
            top_logprobs=tuple(row[1 : 1 + n]),
        )
        for row, token_id, n in zip(rows, token_ids, num_top, strict=True)
    ]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """``logprob_values`` read to the host (one device-to-host copy) and unpacked: one
    ``TokenLogprobs`` per row (shapes and dtypes as ``logprob_values``)."""
    values = logprob_values(logits, token_ids, num_top)
    is_nan = torch.zeros_like(token_ids, dtype=torch.bool)
    results = SampledResults.read(token_ids, is_nan, values)
    return unpack_logprobs(results.logprob_values, results.token_ids, num_top)


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledResults:
    """A step's sampling results on the host, read from the device in ONE copy (``read``).

    Fields:
        token_ids: per sampled row, its token.
        nan_rows: the rows whose logits hold a NaN (their tokens are meaningless).
        logprob_values: ``logprob_values(...)`` of the logprob rows, flattened (empty if none).
    """

    token_ids: list[int]
    nan_rows: list[int]
    logprob_values: list[float]

    @classmethod
    def read(cls, token_ids: Tensor, is_nan: Tensor, logprobs: Tensor | None) -> SampledResults:
        """Pack ``token_ids`` ``[num_rows]`` int64, ``is_nan`` ``[num_rows]`` bool and
        ``logprobs`` (``logprob_values``'s ``[num_logprob_rows, width]`` float64, or None) into one
        float64 tensor on their device and read it (token ids are exact in float64)."""
        parts = [token_ids.to(torch.float64), is_nan.to(torch.float64)]
        if logprobs is not None:
            parts.append(logprobs.flatten())
        values = torch.cat(parts).tolist()  # host sync: the step's one read of its results
        num_rows = token_ids.shape[0]
        flags = values[num_rows : 2 * num_rows]
        return cls(
            token_ids=[int(t) for t in values[:num_rows]],
            nan_rows=[row for row, flag in enumerate(flags) if flag],
            logprob_values=values[2 * num_rows :],
        )


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
        num_logprobs: per row (host ints), top logprobs the request asked for; -1 = no logprobs.
        is_all_greedy: True if every temperature is 0 (skips the random path).
        has_top_p: True if a row with a temperature has a top_p below 1 (else no nucleus sort).
    The two flags and ``num_logprobs`` come from the host-side request parameters, so that the
    sampler decides its path without reading the device tensors.
    """

    temperature: Tensor
    top_p: Tensor
    seeds: Tensor
    output_positions: Tensor
    num_logprobs: tuple[int, ...]
    is_all_greedy: bool
    has_top_p: bool

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of ``rows`` only (in that order). Reads the device values of ``rows``
        (host sync): for the sampler's failure path only, never in a normal step."""
        temperature = self.temperature[rows]
        top_p = self.top_p[rows]
        return SamplingMetadata(
            temperature=temperature,
            top_p=top_p,
            seeds=self.seeds[rows],
            output_positions=self.output_positions[rows],
            num_logprobs=tuple(self.num_logprobs[row] for row in rows),
            is_all_greedy=bool((temperature == 0).all()),
            has_top_p=bool(((temperature > 0) & (top_p < 1)).any()),
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
    """logits [num_rows, vocab_size] (float32) + SamplingMetadata -> token ids [num_rows] int64.

    Reads nothing to the host: the path (greedy only, nucleus or not) is chosen from the
    metadata's host-side flags, and a batch with any temperature samples every row on the random
    path and keeps the greedy token where the temperature is 0 (as vLLM's sampler does), instead
    of selecting the random rows (a value-dependent shape)."""

    def __call__(self, logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        # max's indices are argmax's (the first maximal value per row, as documented for both;
        # NaN counts as maximal in both), in less time than argmax (docs/hardware.md, "Other ops")
        tokens = logits.max(dim=-1).indices
        if metadata.is_all_greedy:
            return tokens
        temperature = metadata.temperature.to(torch.float64)
        is_random = temperature > 0
        # greedy rows divide by 1: their scores are computed, then discarded below
        scores = logits.to(torch.float64) / torch.where(is_random, temperature, 1.0)[:, None]
        if metadata.has_top_p:
            scores = top_p_mask(scores, metadata.top_p)
        uniform = hash_uniform(metadata.seeds, metadata.output_positions, logits.shape[-1])
        sampled = (scores - torch.log(-torch.log(uniform))).argmax(dim=-1)
        return torch.where(is_random, sampled, tokens)
