"""Sampling helpers of the model runner: nucleus (top-p) filtering and logprobs of sampled tokens.

Logprobs are vLLM's default "raw logprobs": ``log_softmax`` of the model's logits before
temperature or top-p, for the sampled token and the ``num_top`` most likely tokens of its row. They
are computed only for the rows of requests that asked for them (no cost otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
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
