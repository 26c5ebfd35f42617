"""The roofline of ``launch.bench_throughput --roofline``: the bytes and FLOPs a step needs, from a
real model's parameters, the per-kind lines of an engine's timed steps (each timed whole:
scheduling and the scheduler's update too), and docs/benchmarks.md's roofline command run on the
CPU with a tiny checkpoint's config, its output in the documented format."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from launch.benchmarks.roofline import ModelTraffic, StepRoofline, copy_bandwidth, matmul_peak
from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command
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


def _run_two_requests(engine) -> StepRoofline:
    """A roofline attached to ``engine``, which then runs two requests (prompts of 3 and 2
    tokens, 3 output tokens each) to the end."""
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
    return roofline


def test_an_engines_steps_are_summed_per_kind_into_one_line_each(engine):

    roofline = _run_two_requests(engine)
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


class _FakeClock:
    """``time`` for the roofline module: ``perf_counter`` advances only when ``tick`` is called."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_a_step_is_timed_whole_scheduling_and_the_update_included(tiny_mixtral_dir, monkeypatch):
    """Time spent in the scheduler (schedule, update_from_output) counts into the step: the
    roofline compares what a user waits for per token, not the forward alone."""
    from launch.benchmarks import roofline as roofline_module

    engine = single_rank_engine(tiny_mixtral_dir, enforce_eager=True)
    clock = _FakeClock()
    monkeypatch.setattr(roofline_module, "time", clock)
    scheduler = engine.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def slow_schedule():
        clock.tick(1.0)
        return schedule()

    def slow_update(*args, **kwargs):
        clock.tick(2.0)
        return update(*args, **kwargs)

    monkeypatch.setattr(scheduler, "schedule", slow_schedule)
    monkeypatch.setattr(scheduler, "update_from_output", slow_update)
    roofline = _run_two_requests(engine)
    totals = roofline.totals
    assert {k: t.num_steps for k, t in totals.items()} == {"prefill": 1, "decode": 2}
    # each step: 1 s scheduling + 2 s applying its tokens (the fake clock moves nowhere else)
    assert totals["prefill"].seconds == 3.0 and totals["decode"].seconds == 6.0
    # counted from the requests as scheduled, before the update moved them on
    traffic = roofline.traffic
    assert totals["prefill"].bytes == pytest.approx(traffic.bytes_read(5, [0, 0]))
    assert totals["decode"].bytes == pytest.approx(
        traffic.bytes_read(2, [3, 2]) + traffic.bytes_read(2, [4, 3])
    )


def _docs_roofline_command() -> list[str]:
    """The arguments of docs/benchmarks.md's roofline command (after the module)."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    section = text[text.index("### Against the device's limits") :]
    block = next(b for b in section.split("```bash\n")[1:] if "--load-format dummy" in b)
    words = block.split("```")[0].replace("\\\n", " ").split()
    prefix = ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "launch.bench_throughput"]
    assert words[: len(prefix)] == prefix
    return words[len(prefix) :]


def _documented_lines() -> list[str]:
    """The output lines the docs give for that command, ``<...>`` marking measured values."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    section = text[text.index("It prints, after the warm-up") :]
    return section.split("```\n")[1].splitlines()


def _as_regex(line: str) -> re.Pattern:
    parts = re.split(r"<[^>]*>", line)
    return re.compile("^" + r"[\d.]+".join(re.escape(p) for p in parts) + "$", re.MULTILINE)


def test_the_documented_roofline_command_runs_on_the_cpu(tiny_mixtral_dir):
    """The command of docs/benchmarks.md with a tiny checkpoint's config (``--load-format
    dummy``), fewer and shorter prompts and a KV cache a CPU can hold; ``--roofline`` (on by
    default off the host only): its Throughput and roofline lines have the documented format."""
    args = _docs_roofline_command()
    assert {"--load-format", "--dtype", "--max-num-seqs"} <= set(args)
    assert "--cudagraph-capture-sizes" not in args and "--enforce-eager" not in args
    smaller = {
        "--model": tiny_mixtral_dir,
        "--num-prompts": "4",
        "--input-len": "6",
        "--output-len": "3",
        "--kv-cache-memory-bytes": "8M",
    }
    for flag, value in smaller.items():
        args[args.index(flag) + 1] = value
    cmd = torchrun_command(1, "launch.bench_throughput", *args, "--roofline")
    env = {**os.environ, **TORCHRUN_ENV}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    documented = [
        line for line in _documented_lines() if line.startswith(("Throughput:", "roofline"))
    ]
    assert [line.split(":")[0] for line in documented] == [
        "Throughput",
        "roofline",
        "roofline decode",
        "roofline prefill",
    ]
    for line in documented:
        assert _as_regex(line).search(proc.stdout), (line, proc.stdout[-2000:])
