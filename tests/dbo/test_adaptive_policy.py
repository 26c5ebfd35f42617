"""The adaptive DBO policy on synthetic step times (deterministic: no clock), alone and inside the
DP vote, on one process and on gloo ranks that each see different local step times."""

from __future__ import annotations

import math

import pytest
import torch

from dbo import (
    AdaptiveDBOPolicy,
    AdaptivePolicyConfig,
    Bucket,
    coordinate_batch_across_dp,
    decide_from_gathered,
    format_crossover,
    prior_from_table,
)
from tests.helpers.distributed import run_distributed

DECODE_64 = Bucket.of(num_tokens=64, is_decode_only=True)


def drive(policy, bucket, step_ms, num_steps):
    """Run ``num_steps`` steps of ``bucket``; ``step_ms(use_ubatch, i)`` is the step's time.
    Returns the (use_ubatch, is_exploring) of every step."""
    trace = []
    for i in range(num_steps):
        choice = policy.choose(bucket)
        policy.begin_step(bucket, choice.use_ubatch)
        policy.record(step_ms(choice.use_ubatch, i))
        trace.append((choice.use_ubatch, choice.is_exploring))
    return trace


def test_buckets_are_powers_of_two_per_kind():
    assert Bucket.of(num_tokens=64, is_decode_only=True) == Bucket.of(
        num_tokens=127, is_decode_only=True
    )
    assert Bucket.of(num_tokens=128, is_decode_only=True).log2_tokens == 7
    assert Bucket.of(num_tokens=1, is_decode_only=False).label == "prefill:1-1"
    assert DECODE_64.label == "decode:64-127" and DECODE_64.min_tokens == 64
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got 0"):
        Bucket.of(num_tokens=0, is_decode_only=True)


@pytest.mark.parametrize("on_is_faster", [True, False])
def test_explores_both_arms_then_keeps_the_faster(on_is_faster):
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=3))
    fast, slow = 10.0, 13.0

    def times(use_ubatch, i):
        return fast if use_ubatch == on_is_faster else slow

    trace = drive(policy, DECODE_64, times, 20)
    # ABBA exploration: off, on, on, off, off, on; then the faster arm every step
    assert trace[:6] == [(False, True), (True, True), (True, True)] + [
        (False, True),
        (False, True),
        (True, True),
    ]
    assert trace[6:] == [(on_is_faster, False)] * 14
    assert policy.num_exploration_steps == 6
    expected = 64.0 if on_is_faster else math.inf
    assert policy.crossover_tokens("decode") == expected
    assert math.isnan(policy.crossover_tokens("prefill"))


def test_flips_when_the_times_cross():
    cfg = AdaptivePolicyConfig(num_explore_steps=2, window=3, drift_tolerance=0.2)
    policy = AdaptiveDBOPolicy(cfg)

    def times(use_ubatch, i):  # until step 20 on is faster; then on becomes 2x slower
        if i < 20:
            return 8.0 if use_ubatch else 10.0
        return 20.0 if use_ubatch else 10.0

    trace = drive(policy, DECODE_64, times, 40)
    assert trace[10:20] == [(True, False)] * 10
    # the chosen arm's median drifts after `window` slow samples: explore again, then switch
    assert trace[-5:] == [(False, False)] * 5
    assert any(exploring for _, exploring in trace[20:30])


def test_recheck_interval_explores_again_without_drift():
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=1, recheck_interval=5))
    trace = drive(policy, DECODE_64, lambda on, i: 5.0 if on else 6.0, 16)
    assert [exploring for _, exploring in trace] == [True, True] + [False] * 5 + [True, True] + [
        False
    ] * 5 + [True, True]


def test_a_tie_goes_to_off_and_noise_is_outvoted_by_the_median():
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(tie_tolerance=0.02))
    tie = drive(policy, DECODE_64, lambda on, i: 10.0 if on else 10.1, 10)
    assert tie[-1] == (False, False)  # on faster by 1 % < tie tolerance: off

    # on is faster, but one of its exploration samples is a 10x outlier (a noisy neighbour)
    noisy = AdaptiveDBOPolicy()
    outlier_at = 1  # the first on-step
    trace = drive(
        noisy,
        DECODE_64,
        lambda on, i: (90.0 if i == outlier_at else 9.0) if on else 10.0,
        10,
    )
    assert trace[-1] == (True, False)


def test_unmeasured_steps_and_steps_outside_the_policy_are_not_samples():
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=1))
    policy.begin_step(DECODE_64, False)
    policy.record(0.0)  # not measured (no rank ran the model)
    policy.record(5.0)  # nothing pending: dropped
    assert policy.choose(DECODE_64).use_ubatch is False and policy.is_exploring(DECODE_64)
    policy.begin_step(DECODE_64, False)
    policy.cancel_pending()
    policy.record(5.0)
    assert policy.summary()["decode:64-127"] == {
        "choice": "exploring",
        "median_ms": {"off": None, "on": None},
    }


def test_crossover_is_the_lowest_bucket_from_which_every_decided_one_chose_on():
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=1))
    for num_tokens, on_wins in ((16, False), (64, True), (256, False), (1024, True), (4096, True)):
        bucket = Bucket.of(num_tokens=num_tokens, is_decode_only=True)
        drive(policy, bucket, lambda on, i, w=on_wins: 1.0 if on == w else 2.0, 2)
    assert policy.crossover_tokens("decode") == 1024.0
    assert format_crossover(1024.0) == ">= 1024 tokens"
    assert format_crossover(math.inf) == "never" and format_crossover(math.nan) == "unknown"
    with pytest.raises(ValueError, match="kind must be one of"):
        policy.crossover_tokens("mixed")


def test_bad_config():
    with pytest.raises(ValueError, match="window \\(2\\) must be >= num_explore_steps \\(3\\)"):
        AdaptivePolicyConfig(num_explore_steps=3, window=2)
    with pytest.raises(ValueError, match="drift_tolerance must be in \\[0, 1\\), got 1.5"):
        AdaptivePolicyConfig(drift_tolerance=1.5)
    with pytest.raises(ValueError, match="num_explore_steps must be >= 1, got 0"):
        AdaptivePolicyConfig(num_explore_steps=0)


def vote_rows(*per_rank):
    """(num_tokens, vote, is_decode_only, can_ubatch, prev_step_us) per rank -> [dp, 7] int64
    (two ubatches asked for)."""
    return torch.tensor(
        [(n, v, int(n > 0), d, c, us, 2) for n, v, d, c, us in per_rank], dtype=torch.int64
    )


def test_in_the_vote_the_slowest_rank_is_the_sample_and_all_ranks_agree():
    policies = [AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=1)) for _ in range(2)]
    adaptive = frozenset({"decode"})
    choices = []
    # rank 0 is fast, rank 1 is slow: the max (rank 1) decides. off: 10 ms/12 ms, on: 9 ms/11 ms
    local_us = {False: (10_000, 12_000), True: (9_000, 11_000)}
    prev = (0, 0)
    for _ in range(6):
        table = vote_rows((64, 0, 1, 1, prev[0]), (64, 0, 1, 1, prev[1]))
        decisions = [
            decide_from_gathered(table, r, policy=policies[r], adaptive_kinds=adaptive)
            for r in range(2)
        ]
        assert decisions[0].should_ubatch == decisions[1].should_ubatch
        assert decisions[0].adaptive == decisions[1].adaptive
        choices.append(decisions[0].should_ubatch)
        prev = local_us[decisions[0].should_ubatch]
    assert choices == [False, True, True, True, True, True]
    assert policies[0].summary() == policies[1].summary()


def test_a_static_kind_keeps_the_threshold_vote_and_a_rank_that_cannot_ubatch_vetoes():
    policy = AdaptiveDBOPolicy()
    # decode is adaptive, but one rank prefills: the step is "prefill" (static): votes decide
    table = vote_rows((64, 1, 1, 1, 0), (64, 1, 0, 1, 0))
    decision = decide_from_gathered(table, 0, policy=policy, adaptive_kinds=frozenset({"decode"}))
    assert decision.should_ubatch and decision.adaptive is None
    # adaptive prefill exploring "on", but rank 1 cannot microbatch: off (and recorded as off)
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=1))
    kinds = frozenset({"prefill"})
    decide_from_gathered(
        vote_rows((64, 1, 0, 1, 0), (64, 1, 0, 1, 0)), 0, policy=policy, adaptive_kinds=kinds
    )
    wants_on = decide_from_gathered(
        vote_rows((64, 1, 0, 1, 900), (64, 1, 0, 0, 1000)), 0, policy=policy, adaptive_kinds=kinds
    )
    assert wants_on.adaptive.use_ubatch and not wants_on.should_ubatch
    with pytest.raises(ValueError, match="need a policy"):
        decide_from_gathered(table, 0, adaptive_kinds=kinds)


def _adaptive_ranks(rank, world_size, num_steps):
    """Rank function: ranks see different local step times (a fake timer per rank: rank r is
    (1 + r) times slower, with per-rank jitter, and on the slowest rank microbatching loses in the
    larger bucket only); every rank must still take the same decision every step."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    policy = AdaptiveDBOPolicy(AdaptivePolicyConfig(num_explore_steps=2, window=3))
    prev_us, trace = 0, []
    for step in range(num_steps):
        num_tokens = (64, 300)[step % 2] + rank  # two buckets, different sizes per rank
        decision = coordinate_batch_across_dp(
            num_tokens=num_tokens,
            has_work=True,
            vote=True,
            dp_group=dist.group.WORLD,
            dp_rank=rank,
            dp_size=world_size,
            is_decode_only=True,
            can_ubatch=True,
            prev_step_us=prev_us,
            policy=policy,
            adaptive_kinds=frozenset({"decode"}),
        )
        fake_us = 1000 * (1 + rank) * (8 if decision.should_ubatch else 10)
        if rank == world_size - 1 and step % 2 == 1:
            fake_us += 10_000 * decision.should_ubatch  # the slowest rank loses with DBO here
        prev_us = fake_us + 37 * rank + step  # jitter that differs per rank
        trace.append((decision.should_ubatch, decision.adaptive.is_exploring))
    return trace, policy.summary(), policy.crossover_tokens("decode")


def test_ranks_with_different_local_times_agree_every_step():
    per_rank = run_distributed(_adaptive_ranks, 3, 30, timeout_s=60)
    traces = [trace for trace, _, _ in per_rank]
    assert traces[0] == traces[1] == traces[2]
    assert per_rank[0][1] == per_rank[1][1] == per_rank[2][1]
    # decided by the slowest rank: on pays in the small bucket, not in the large one
    assert per_rank[0][2] == math.inf
    assert per_rank[0][1]["decode:64-127"]["choice"] == "on"
    assert per_rank[0][1]["decode:256-511"]["choice"] == "off"


def _prior(speedup):
    return lambda bucket: speedup


@pytest.mark.parametrize("on_is_faster", [True, False])
def test_an_agreeing_prior_halves_the_exploration(on_is_faster):
    policy = AdaptiveDBOPolicy(prior=_prior(1.4 if on_is_faster else 0.6))

    def times(use_ubatch, i):
        return 10.0 if use_ubatch == on_is_faster else 13.0

    trace = drive(policy, DECODE_64, times, 12)
    # 2 samples per arm (off, on, on, off) instead of 4, then the faster arm
    assert trace[:4] == [(False, True), (True, True), (True, True), (False, True)]
    assert trace[4:] == [(on_is_faster, False)] * 8
    assert policy.num_exploration_steps == 4


def test_a_contradicted_prior_explores_fully_and_the_samples_decide():
    policy = AdaptiveDBOPolicy(prior=_prior(1.5))  # predicts on; off is faster

    trace = drive(policy, DECODE_64, lambda on, i: 13.0 if on else 10.0, 12)
    assert [e for _, e in trace[:8]] == [True] * 8  # the full 4 + 4 steps
    assert trace[8:] == [(False, False)] * 4
    assert policy.num_exploration_steps == 8


def test_an_unsure_or_missing_prior_changes_nothing():
    for prior in (_prior(1.05), _prior(None), None):
        policy = AdaptiveDBOPolicy(prior=prior)
        drive(policy, DECODE_64, lambda on, i: 10.0 if on else 13.0, 12)
        assert policy.num_exploration_steps == 8


def test_rechecks_explore_fully_with_a_prior():
    cfg = AdaptivePolicyConfig(recheck_interval=3)
    policy = AdaptiveDBOPolicy(cfg, prior=_prior(1.5))
    trace = drive(policy, DECODE_64, lambda on, i: 10.0 if on else 13.0, 4 + 3 + 8)
    assert [e for _, e in trace] == [True] * 4 + [False] * 3 + [True] * 8


def test_prior_from_table():
    prior = prior_from_table({"format": "x", "decode": {"6": 0.7, "8": 1.3}, "prefill": {"10": 0}})
    assert prior(DECODE_64) == 0.7
    assert prior(Bucket(kind="decode", log2_tokens=7)) is None
    assert prior(Bucket(kind="prefill", log2_tokens=10)) is None  # 0: no prediction
    with pytest.raises(ValueError, match="bad entry decode"):
        prior_from_table({"decode": {"x": 1.0}})
    with pytest.raises(ValueError, match="'prefill' must map"):
        prior_from_table({"prefill": [1.0]})
    with pytest.raises(ValueError, match="num_prior_explore_steps must be >= 1"):
        AdaptivePolicyConfig(num_prior_explore_steps=0)
    with pytest.raises(ValueError, match="prior_margin must be in"):
        AdaptivePolicyConfig(prior_margin=1.5)
