"""The roofline of ``launch.bench_throughput --roofline``: the bytes and FLOPs a step needs, from a
real model's parameters, and the per-kind lines of an engine's timed steps."""

from __future__ import annotations

import pytest
import torch

from launch.benchmarks.roofline import ModelTraffic, StepRoofline, copy_bandwidth, matmul_peak
from tests.helpers.single_rank import single_rank_engine


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir):
    return single_rank_engine(tiny_mixtral_dir, enforce_eager=True)


def test_traffic_counts_every_parameter_once(engine):
    model = engine.model
    traffic = ModelTraffic.of(model, torch.float32)
    config = model.config
    # tiny Mixtral: 8 experts of w1, w2, w3 = 3 x hidden x intermediate each, in every layer
    assert traffic.num_moe_layers == config.num_hidden_layers and traffic.num_local_experts == 8
    assert traffic.expert_params == 3 * config.hidden_size * config.intermediate_size
    assert traffic.expert_bytes == 4 * traffic.expert_params
    total = sum(p.numel() for p in model.parameters())
    experts = traffic.num_moe_layers * traffic.num_local_experts * traffic.expert_params
    embed = model.model.embed_tokens.weight.numel()  # untied: its rows are gathered, not read
    assert traffic.dense_bytes == 4 * (total - experts - embed)
    assert traffic.dense_params + traffic.lm_head_params == total - experts - embed


def test_experts_touched_and_bytes_follow_the_balanced_routing_expectation(engine):
    traffic = ModelTraffic.of(engine.model, torch.float32)
    assert traffic.experts_touched(0) == 0
    assert traffic.experts_touched(1) == pytest.approx(2)  # top-2: two distinct experts
    assert traffic.experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert traffic.experts_touched(10_000) == pytest.approx(8)
    one = traffic.bytes_read(1, [9])
    expected = (
        traffic.dense_bytes
        + traffic.num_moe_layers * 2 * traffic.expert_bytes
        + traffic.kv_bytes_per_token * 10
    )
    assert one == pytest.approx(expected)
    # attention: 2 x heads x (qk + v head dims) per layer and attended token
    config = engine.model.config
    per_token = 2 * config.num_attention_heads * 2 * config.head_dim * config.num_hidden_layers
    assert traffic.attention_flops_per_context_token == per_token


def test_an_engines_steps_are_summed_per_kind_into_one_line_each(engine):
    from launch.engine.request import Request, SamplingParams

    roofline = StepRoofline(
        traffic=ModelTraffic.of(engine.model, torch.float32), bandwidth=1e10, peak=1e11
    )
    roofline.attach(engine, lambda: None)
    for i, prompt in enumerate(([3, 4, 5], [6, 7])):
        engine.add_request(
            Request(
                request_id=i, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=3)
            )
        )
    engine.run_until_done()
    assert {k: t.num_steps for k, t in roofline.totals.items()} == {"prefill": 1, "decode": 2}
    prefill = roofline.totals["prefill"]
    # one prefill step of 5 tokens, both requests sampled: causal attention over 3 and 2 rows
    traffic = roofline.traffic
    assert prefill.flops == pytest.approx(traffic.matmul_flops(5, 2, 6 + 3))
    assert prefill.bytes == pytest.approx(traffic.bytes_read(5, [0, 0]))
    lines = roofline.lines()
    assert lines[0] == "roofline: copy bandwidth 10.0 GB/s, matmul peak 0.10 TFLOP/s"
    assert lines[1].startswith("roofline decode: 2 steps, ") and "of the matmul peak" in lines[1]
    assert lines[2].startswith("roofline prefill: 1 steps, ")


def test_the_limits_are_measured_on_the_device():
    cpu = torch.device("cpu")
    assert copy_bandwidth(cpu, lambda: None, mib=4) > 1e8  # bytes/s
    assert matmul_peak(cpu, torch.float32, lambda: None, n=128) > 1e8  # FLOP/s
