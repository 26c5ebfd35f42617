"""Shared by the all-to-all tests: seeded per-rank inputs, reference experts (an elementwise scale
per expert) and a cheap closeness check."""

from __future__ import annotations

import torch

from distributed import BatchedDispatchResult

HIDDEN_SIZE = 12


def make_inputs(
    seed: int, rank: int, num_tokens: int, num_topk: int, num_experts: int, dtype, skew=False
):
    """Rank ``rank``'s (hidden_states, topk_ids, topk_weights); -1 in some slots when num_topk > 1.
    ``skew``: every token picks experts 0, 1, … (all on the first ranks: the others get nothing)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    hidden_states = torch.randn(num_tokens, HIDDEN_SIZE, generator=gen).to(dtype)
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :num_topk]
    if skew:
        topk_ids = torch.arange(num_topk).expand(num_tokens, num_topk).clone()
    topk_weights = torch.rand(num_tokens, num_topk, generator=gen)
    topk_weights /= topk_weights.sum(dim=1, keepdim=True)
    if num_topk > 1 and num_tokens > 1:
        topk_ids[1, -1] = -1  # a slot with no expert (DeepEP: -1 = no selection)
        topk_weights[1, -1] = 0.0
    return hidden_states, topk_ids, topk_weights


def expert_scales(seed: int, num_experts: int) -> torch.Tensor:
    """Expert e multiplies its input elementwise by scales[e] ([num_experts, hidden], float32)."""
    gen = torch.Generator().manual_seed(seed + 7)
    return 0.5 + torch.rand(num_experts, HIDDEN_SIZE, generator=gen)


def apply_experts(x, topk_ids, topk_weights, scales, first_expert: int) -> torch.Tensor:
    """Σ_k topk_weights[:, k] · x · scales[first_expert + topk_ids[:, k]], slots with id >= 0."""
    out = torch.zeros(x.shape[0], HIDDEN_SIZE, dtype=torch.float32)
    for k in range(topk_ids.shape[1]):
        valid = topk_ids[:, k] >= 0
        scale = scales[first_expert + topk_ids[:, k].clamp(min=0)]
        out += torch.where(valid, topk_weights[:, k], 0.0)[:, None] * x.float() * scale
    return out


def assert_close(actual, expected, *, atol: float, rtol: float) -> None:
    """Elementwise |actual - expected| <= atol + rtol * |expected| (torch.testing's first call
    costs about a second per process, which the spawned ranks would all pay)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    assert bool((diff <= bound).all()), f"max abs diff {diff.max().item():.3g} exceeds tolerance"


def valid_batched_rows(result: BatchedDispatchResult) -> list[torch.Tensor]:
    counts = result.expert_num_tokens.tolist()
    return [result.hidden_states[local, :n] for local, n in enumerate(counts)]


def run_experts(result, scales, first_expert: int) -> torch.Tensor:
    """The reference experts on a dispatch result, in its format: weighted rows (standard) or
    unweighted per-expert outputs with rows past the counts left at zero (batched)."""
    if isinstance(result, BatchedDispatchResult):
        out = torch.zeros(result.hidden_states.shape, dtype=torch.float32)
        for local, rows in enumerate(valid_batched_rows(result)):
            out[local, : rows.shape[0]] = rows.float() * scales[first_expert + local]
        return out.to(result.hidden_states.dtype)
    return apply_experts(
        result.hidden_states, result.topk_ids, result.topk_weights, scales, first_expert
    ).to(result.hidden_states.dtype)
