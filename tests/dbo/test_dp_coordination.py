"""The DP-wide microbatching decision: hand-made gathered tables, then real gloo runs."""

from __future__ import annotations

import pytest
import torch

from dbo import (
    DPMicrobatchDecision,
    coordinate_batch_across_dp,
    decide_from_gathered,
    should_ubatch_locally,
)
from tests.helpers.distributed import run_distributed


def rows(*per_rank, num_ubatches=2):
    """(num_tokens, vote, has_work[, num_ubatches]) per rank -> the [dp_size, 7] int64 vote table
    (decode-only, can_ubatch = vote, no step time; ``num_ubatches`` where a row gives none)."""
    return torch.tensor(
        [(*r[:3], 1, r[1], 0, r[3] if len(r) > 3 else num_ubatches) for r in per_rank],
        dtype=torch.int64,
    )


def test_should_ubatch_locally_uses_the_threshold_of_the_batch_kind():
    kw = {"decode_token_threshold": 32, "prefill_token_threshold": 512}
    assert should_ubatch_locally(num_tokens=32, is_decode_only=True, **kw)
    assert not should_ubatch_locally(num_tokens=31, is_decode_only=True, **kw)
    assert not should_ubatch_locally(num_tokens=511, is_decode_only=False, **kw)
    assert should_ubatch_locally(num_tokens=512, is_decode_only=False, **kw)
    with pytest.raises(ValueError, match="decode_token_threshold must be >= 0, got -1"):
        should_ubatch_locally(
            num_tokens=1, is_decode_only=True, decode_token_threshold=-1, prefill_token_threshold=0
        )


def test_all_vote_yes_pads_to_the_max():
    table = rows((8, 1, 1), (6, 1, 1))
    assert decide_from_gathered(table, 0) == DPMicrobatchDecision(
        should_ubatch=True,
        num_tokens_across_dp=[8, 6],
        num_tokens_padded=8,
        has_work_across_dp=[True, True],
        num_ubatches=2,
    )
    assert decide_from_gathered(table, 1).num_tokens_padded == 8


def test_one_no_vote_means_nobody_ubatches():
    table = rows((8, 1, 1), (6, 0, 1), (9, 1, 1))
    decisions = [decide_from_gathered(table, r) for r in range(3)]
    assert [d.should_ubatch for d in decisions] == [False] * 3
    assert [d.num_tokens_padded for d in decisions] == [8, 6, 9]  # each rank's own count
    assert decisions[0].num_tokens_across_dp == [8, 6, 9]


def test_abort_when_a_second_ubatch_would_be_empty():
    # padded to 16, split point 8: rank 1's 8 real tokens all fall in its first ubatch
    decision = decide_from_gathered(rows((16, 1, 1), (8, 1, 1)), 1)
    assert not decision.should_ubatch
    assert decision.num_tokens_padded == 8
    # one more real token on rank 1 and its second ubatch has a real token
    assert decide_from_gathered(rows((16, 1, 1), (9, 1, 1)), 1).should_ubatch
    # a rank without work (dummy batch of 0 tokens) can never ubatch
    idle = decide_from_gathered(rows((64, 1, 1), (0, 1, 0)), 0)
    assert not idle.should_ubatch
    assert idle.has_work_across_dp == [True, False]


def _num_ubatches(table) -> int:
    decisions = [decide_from_gathered(table, r) for r in range(table.shape[0])]
    assert len({d.num_ubatches for d in decisions}) == 1  # every rank agrees
    assert all(d.should_ubatch == (d.num_ubatches >= 2) for d in decisions)
    return decisions[0].num_ubatches


def test_n_ubatches_fall_back_to_the_most_without_an_empty_one():
    # padded to 12: ubatches start at rows 0, 3, 6, 9; every rank has real tokens past row 9
    assert _num_ubatches(rows((12, 1, 1), (12, 1, 1), num_ubatches=4)) == 4
    # padded to 16, 11 real tokens on rank 1: of 4 ubatches the last starts at row 12 (empty on
    # rank 1), of 3 at row 10 (has a real token)
    assert _num_ubatches(rows((16, 1, 1), (11, 1, 1), num_ubatches=4)) == 3
    # 9 real tokens: 3 ubatches start their last at row 10, 2 at row 8
    assert _num_ubatches(rows((16, 1, 1), (9, 1, 1), num_ubatches=4)) == 2
    # 8 real tokens: even the second of two ubatches (row 8) is empty: nobody microbatches
    assert _num_ubatches(rows((16, 1, 1), (8, 1, 1), num_ubatches=3)) == 1
    # fewer rows than ubatches: a ubatch would have no row at all
    assert _num_ubatches(rows((3, 1, 1), (3, 1, 1), num_ubatches=4)) == 3
    assert _num_ubatches(rows((2, 1, 1), (2, 1, 1), num_ubatches=4)) == 2
    # ranks that ask for different counts use the smallest
    assert _num_ubatches(rows((12, 1, 1, 4), (12, 1, 1, 3))) == 3
    # a no vote still means nobody microbatches, whatever the count
    assert _num_ubatches(rows((12, 1, 1), (12, 0, 1), num_ubatches=4)) == 1


def test_decision_checks_num_ubatches_against_should_ubatch():
    kw = {"num_tokens_across_dp": [4], "num_tokens_padded": 4, "has_work_across_dp": [True]}
    with pytest.raises(ValueError, match="num_ubatches must be >= 2 when microbatching, else 1"):
        DPMicrobatchDecision(should_ubatch=True, num_ubatches=1, **kw)
    with pytest.raises(ValueError, match="got 3 with should_ubatch=False"):
        DPMicrobatchDecision(should_ubatch=False, num_ubatches=3, **kw)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"rows must be \[dp_size >= 1, 7\], got shape \(2, 3\)"):
        decide_from_gathered(torch.zeros(2, 3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\), got 2"):
        decide_from_gathered(rows((1, 1, 1), (1, 1, 1)), 2)
    with pytest.raises(ValueError, match="dp_group is required"):
        coordinate_batch_across_dp(
            num_tokens=4, has_work=True, vote=True, dp_group=None, dp_rank=0, dp_size=2
        )
    with pytest.raises(ValueError, match="num_ubatches must be >= 2, got 1"):
        coordinate_batch_across_dp(
            num_tokens=4,
            has_work=True,
            vote=True,
            dp_group=None,
            dp_rank=0,
            dp_size=1,
            num_ubatches=1,
        )


def test_single_rank_needs_no_group():
    decision = coordinate_batch_across_dp(
        num_tokens=6, has_work=True, vote=True, dp_group=None, dp_rank=0, dp_size=1
    )
    assert decision.should_ubatch and decision.num_tokens_padded == 6


def _coordinate_scenarios(rank, world_size, scenarios):
    """Rank function: run one coordination per scenario ((num_tokens, vote, has_work[,
    num_ubatches]) per rank); per scenario
    (should_ubatch, counts, padded, has_work, num_ubatches)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = []
    for scenario in scenarios:
        num_tokens, vote, has_work, *num_ubatches = scenario[rank]
        decision = coordinate_batch_across_dp(
            num_tokens=num_tokens,
            has_work=has_work,
            vote=vote,
            dp_group=dist.group.WORLD,
            dp_rank=rank,
            dp_size=world_size,
            num_ubatches=num_ubatches[0] if num_ubatches else 2,
        )
        results.append(
            (
                decision.should_ubatch,
                decision.num_tokens_across_dp,
                decision.num_tokens_padded,
                decision.has_work_across_dp,
                decision.num_ubatches,
            )
        )
    return results


def test_two_ranks_over_gloo():
    scenarios = [
        [(8, True, True), (6, True, True)],  # ubatch, pad to 8
        [(8, True, True), (6, False, True)],  # one no vote
        [(16, True, True), (8, True, True)],  # empty second ubatch on rank 1: abort
        [(16, True, True, 4), (11, True, True, 4)],  # 4 asked, the 4th empty on rank 1: 3
    ]
    per_rank = run_distributed(_coordinate_scenarios, 2, scenarios, timeout_s=60)
    assert per_rank[0] == [
        (True, [8, 6], 8, [True, True], 2),
        (False, [8, 6], 8, [True, True], 1),
        (False, [16, 8], 16, [True, True], 1),
        (True, [16, 11], 16, [True, True], 3),
    ]
    assert [r[2] for r in per_rank[1]] == [8, 6, 8, 16]
    assert [r[0] for r in per_rank[1]] == [True, False, False, True]
    assert [r[4] for r in per_rank[1]] == [2, 1, 1, 3]


def test_four_ranks_over_gloo():
    scenarios = [
        [(12, True, True), (7, True, True), (9, True, True), (10, True, True)],
        [(12, True, True), (0, True, False), (9, True, True), (10, True, True)],
    ]
    per_rank = run_distributed(_coordinate_scenarios, 4, scenarios, timeout_s=90)
    for rank, results in enumerate(per_rank):
        assert results[0] == (True, [12, 7, 9, 10], 12, [True] * 4, 2), rank
        should_ubatch, counts, padded, has_work, _ = results[1]
        assert not should_ubatch
        assert counts == [12, 0, 9, 10]
        assert padded == scenarios[1][rank][0]
        assert has_work == [True, False, True, True]
