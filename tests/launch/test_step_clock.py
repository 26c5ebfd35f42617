"""The model runner's step clock synchronises the device only while the adaptive DBO policy, its
one reader, runs (a threshold ``auto``): a step with static thresholds never waits for the device
beyond the read of its results."""

from __future__ import annotations

import types

import pytest
import torch

from launch.engine.arg_utils import EngineArgs
from launch.engine.model_runner import ModelRunner


@pytest.mark.parametrize(
    ("settings", "is_timed"),
    [
        ({"enable_dbo": False}, False),
        ({"enable_dbo": True, "dbo_decode_token_threshold": 8}, False),
        ({"enable_dbo": False, "dbo_decode_token_threshold": "auto"}, False),
        ({"enable_dbo": True, "dbo_decode_token_threshold": "auto"}, True),
        ({"enable_dbo": True, "dbo_prefill_token_threshold": "auto"}, True),
    ],
)
def test_step_clock_syncs_only_for_the_adaptive_policy(settings, is_timed):
    syncs = []
    runner = types.SimpleNamespace(
        args=EngineArgs(data_parallel_size=2, enable_expert_parallel=True, **settings),
        platform=types.SimpleNamespace(synchronize=syncs.append),
        groups=types.SimpleNamespace(device=torch.device("cpu")),
        clock_ns=lambda: 5_000_000,
        _prev_step_us=0,
    )
    decision = types.SimpleNamespace(adaptive=None, should_ubatch=False)
    ModelRunner._end_step_timing(runner, 1_000_000, decision)
    assert syncs == ([torch.device("cpu")] if is_timed else [])
    assert runner._prev_step_us == (4000 if is_timed else 0)  # 0: "not measured"
