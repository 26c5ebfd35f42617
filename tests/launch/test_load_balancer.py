"""DPLoadBalancer: least-loaded assignment, lowest rank on a tie, closing frees a slot."""

from __future__ import annotations

import pytest

from launch.serving.load_balancer import DPLoadBalancer


def test_least_loaded_then_lowest_rank():
    balancer = DPLoadBalancer(3)
    assert [balancer.assign(i) for i in range(4)] == [0, 1, 2, 0]
    balancer.close(1)  # rank 1 now has no open request
    assert balancer.assign(10) == 1
    balancer.close(99)  # unknown ids are ignored
    assert balancer.num_open == [2, 1, 1]


def test_rejects_empty_dp():
    with pytest.raises(ValueError, match="dp_size must be >= 1, got 0"):
        DPLoadBalancer(0)
