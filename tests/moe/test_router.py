"""select_experts on hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch

from moe import RoutingResult, select_experts


def test_hand_worked_top2_renormalized():
    # softmax(log p) = p: probabilities 0.1, 0.2, 0.3, 0.4 and 0.4, 0.1, 0.1, 0.4
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.1, 0.4]]).log()
    result = select_experts(logits, 2)
    assert isinstance(result, RoutingResult)
    assert result.topk_ids.dtype == torch.int64 and result.topk_weights.dtype == torch.float32
    assert result.topk_ids[0].tolist() == [3, 2]
    torch.testing.assert_close(result.topk_weights[0], torch.tensor([4 / 7, 3 / 7]))
    assert sorted(result.topk_ids[1].tolist()) == [0, 3]
    torch.testing.assert_close(result.topk_weights[1], torch.tensor([0.5, 0.5]))


def test_without_renormalize_keeps_softmax_probabilities():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    result = select_experts(logits, 1, renormalize=False)
    assert result.topk_ids.tolist() == [[1]]
    torch.testing.assert_close(result.topk_weights, torch.tensor([[0.75]]))


def test_bf16_logits_are_routed_in_float32():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    result = select_experts(logits, 2)
    assert result.topk_weights.dtype == torch.float32
    torch.testing.assert_close(result.topk_weights.sum(-1), torch.ones(5))


def test_zero_tokens():
    result = select_experts(torch.zeros(0, 4), 2)
    assert result.topk_ids.shape == (0, 2) and result.topk_weights.shape == (0, 2)


@pytest.mark.parametrize("top_k", [0, 5])
def test_top_k_out_of_range(top_k):
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        select_experts(torch.zeros(3, 4), top_k)


def test_logits_must_be_2d():
    with pytest.raises(ValueError, match=r"\[num_tokens, num_experts\]"):
        select_experts(torch.zeros(2, 3, 4), 2)
