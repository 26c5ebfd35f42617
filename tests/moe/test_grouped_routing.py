"""Grouped and biased top-k on hand-worked cases (DeepSeek-V2 group_limited_greedy, V3 noaux_tc).

Scores are chosen so that the grouped choice DIFFERS from a plain top-k over all experts, and the
logits are built as the inverse of the scoring function (log p for softmax, logit s for sigmoid) so
every expected weight can be read off the table. Tolerance 1e-6: float32 round trip of log/exp.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe import RoutingConfig, select_experts


def _sorted_pairs(result):
    ids, weights = result.topk_ids[0].tolist(), result.topk_weights[0].tolist()
    return sorted(zip(ids, weights, strict=True), key=lambda p: -p[1])


def test_group_limited_greedy_keeps_only_the_best_groups():
    # groups of 2: g0 (e0, e1) = .18 .17 | g1 = .19 .05 | g2 = .30 .04 | g3 = .04 .03 (sum 1)
    probs = [0.18, 0.17, 0.19, 0.05, 0.30, 0.04, 0.04, 0.03]
    logits = torch.tensor([[math.log(p) for p in probs]])
    config = RoutingConfig(
        num_experts=8,
        top_k=3,
        renormalize=False,
        topk_method="group_limited_greedy",
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )
    # groups ranked by their best expert: g2 (.30), g1 (.19) win; g0 (.18) is out, so e0 (.18) loses
    # to e3 (.05)
    got = _sorted_pairs(select_experts(logits, config=config))
    assert [i for i, _ in got] == [4, 2, 3]
    assert [w for _, w in got] == pytest.approx([0.45, 0.285, 0.075], abs=1e-6)
    plain = _sorted_pairs(select_experts(logits, 3, renormalize=False))
    assert [i for i, _ in plain] == [4, 2, 0]


def test_noaux_tc_ranks_groups_by_top2_biased_sum_and_weights_by_unbiased_scores():
    scores = [0.9, 0.1, 0.6, 0.6, 0.8, 0.2, 0.55, 0.45]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.15, 0.30])
    logits = torch.logit(torch.tensor([scores], dtype=torch.float64)).float()
    config = RoutingConfig(
        num_experts=8,
        top_k=2,
        renormalize=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        has_score_correction_bias=True,
    )
    # biased: .9 .1 | .6 .6 | .8 .2 | .70 .75 -> top-2 sums 1.0 | 1.2 | 1.0 | 1.45: g3 and g1 stay
    # (g0 holds the best single expert, .9, yet is dropped). Top-2 biased among e2 e3 e6 e7: e7
    # (.75), e6 (.70). Weights: unbiased .45, .55 renormalised to sum 1, times 2.5.
    got = _sorted_pairs(select_experts(logits, config=config, e_score_correction_bias=bias))
    assert [i for i, _ in got] == [6, 7]
    assert [w for _, w in got] == pytest.approx([0.55 * 2.5, 0.45 * 2.5], abs=1e-6)


def test_noaux_tc_without_renormalize_and_all_groups_is_biased_greedy():
    scores = [0.9, 0.1, 0.6, 0.6]
    logits = torch.logit(torch.tensor([scores], dtype=torch.float64)).float()
    bias = torch.tensor([0.0, 0.6, 0.0, 0.0])
    config = RoutingConfig(
        num_experts=4,
        top_k=2,
        renormalize=False,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_expert_group=2,
        topk_group=2,
        has_score_correction_bias=True,
    )
    got = _sorted_pairs(select_experts(logits, config=config, e_score_correction_bias=bias))
    # biased .9 .7 .6 .6: e0 and e1; the weights are the raw (unbiased) sigmoid scores .9 and .1
    assert [i for i, _ in got] == [0, 1]
    assert [w for _, w in got] == pytest.approx([0.9, 0.1], abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(topk_method="noaux_tc"), r"needs scoring_func 'sigmoid'"),
        (dict(topk_method="group_limited_greedy", num_expert_group=3), r"n_group \(3\)"),
        (
            dict(topk_method="group_limited_greedy", num_expert_group=4, topk_group=5),
            r"topk_group must be in \[1, n_group=4\], got 5",
        ),
        (dict(topk_method="top_p"), r"topk_method 'top_p' not supported"),
    ],
)
def test_bad_routing_configs(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        RoutingConfig(num_experts=8, top_k=2, **kwargs)
