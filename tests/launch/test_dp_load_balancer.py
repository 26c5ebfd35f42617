"""DPLoadBalancer: SGLang's three methods, lowest rank on a tie, closing frees a slot."""

from __future__ import annotations

import pytest

from launch.engine.dp_load_balancer import DPLoadBalancer, assign_offline


def test_shortest_queue_then_lowest_rank():
    balancer = DPLoadBalancer(3)
    assert [balancer.assign(i) for i in range(4)] == [0, 1, 2, 0]
    balancer.close(1)  # rank 1 now has no open request
    assert balancer.assign(10) == 1
    balancer.close(99)  # unknown ids are ignored
    assert balancer.num_open == [2, 1, 1]


def test_round_robin_ignores_closes():
    balancer = DPLoadBalancer(2, "round_robin")
    assert [balancer.assign(i) for i in range(3)] == [0, 1, 0]
    balancer.close(0)
    balancer.close(2)
    assert balancer.assign(3) == 1  # rank 0 is now empty, but it is rank 1's turn


def test_minimum_tokens_balances_lengths_and_frees_on_close():
    balancer = DPLoadBalancer(2, "minimum_tokens")
    assert [balancer.assign(i, n) for i, n in enumerate([100, 10, 10, 10])] == [0, 1, 1, 1]
    assert balancer.num_open_tokens == [100, 30]
    balancer.close(0)
    assert balancer.assign(4, 50) == 0


def test_assign_offline_minimum_tokens_evens_out_the_busiest_rank():
    lengths = [500, 20, 480, 30, 450, 25, 470, 40]  # round robin puts every long one on rank 0

    def load(ranks):
        return [sum(n for n, r in zip(lengths, ranks, strict=True) if r == k) for k in (0, 1)]

    assert load(assign_offline(lengths, dp_size=2, method="round_robin")) == [1900, 115]
    assert load(assign_offline(lengths, dp_size=2, method="shortest_queue")) == [1900, 115]
    balanced = load(assign_offline(lengths, dp_size=2, method="minimum_tokens"))
    assert balanced == [1025, 990]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_size": 0}, "dp_size must be >= 1, got 0"),
        ({"dp_size": 2, "method": "random"}, "--load-balance-method 'random' is not one of"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPLoadBalancer(**kwargs)
