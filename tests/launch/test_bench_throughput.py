"""``launch.bench_throughput``: request sampling, vLLM's summary line, and a short 2-rank run."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess

import pytest

from launch.benchmarks.throughput import sample_requests
from launch.generate import load_prompts
from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command

# vLLM's benchmarks/throughput.py prints
# f"Throughput: {r:.2f} requests/s, {t:.2f} total tokens/s, {o:.2f} output tokens/s"
VLLM_LINE = re.compile(
    r"^Throughput: (\d+\.\d\d) requests/s, (\d+\.\d\d) total tokens/s, "
    r"(\d+\.\d\d) output tokens/s$",
    re.MULTILINE,
)
VLLM_JSON_KEYS = {
    "model_id",
    "elapsed_time",
    "num_requests",
    "total_num_tokens",
    "requests_per_second",
    "tokens_per_second",
}


def _random(**overrides):
    kw = dict(
        dataset_name="random",
        dataset_path=None,
        num_prompts=50,
        input_len=20,
        output_len=10,
        range_ratio=0.5,
        seed=3,
        vocab_size=100,
        load_prompts=load_prompts,
    )
    return sample_requests(**{**kw, **overrides})


def test_random_requests_are_seeded_and_in_range():
    requests = _random()
    assert requests == _random()
    assert requests != _random(seed=4)
    assert {len(r.prompt_token_ids) for r in requests} <= set(range(10, 31))
    assert {r.output_len for r in requests} <= set(range(5, 16))
    assert len({len(r.prompt_token_ids) for r in requests}) > 5  # the ratio spreads them
    assert all(0 <= t < 100 for r in requests for t in r.prompt_token_ids)
    fixed = _random(range_ratio=0.0)
    assert {len(r.prompt_token_ids) for r in fixed} == {20} and {r.output_len for r in fixed} == {
        10
    }


def test_jsonl_requests_cycle_the_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6]}\n{"prompt_token_ids": [7]}\n')
    requests = _random(dataset_name="jsonl", dataset_path=str(path), num_prompts=3)
    assert [r.prompt_token_ids for r in requests] == [[5, 6], [7], [5, 6]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dataset_name": "sharegpt"}, "--dataset-name 'sharegpt' is not one of"),
        ({"dataset_name": "jsonl"}, "needs --dataset-path"),
        ({"num_prompts": 0}, "--num-prompts must be >= 1, got 0"),
        ({"range_ratio": 1.0}, r"--random-range-ratio must be in \[0, 1\), got 1.0"),
    ],
)
def test_bad_bench_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        _random(**overrides)


@pytest.mark.slow
def test_two_rank_run_prints_vllm_line_and_writes_json(tmp_path):
    out, tokens = tmp_path / "result.json", tmp_path / "tokens.jsonl"
    cmd = torchrun_command(
        2,
        "launch.bench_throughput",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--enable-dbo",
        "--dbo-decode-token-threshold",
        "2",
        "--dbo-prefill-token-threshold",
        "4",
        "--num-prompts",
        "6",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--output-json",
        str(out),
        "--output-tokens",
        str(tokens),
        "--profile",
        "--profiler-config",
        json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "profile")}),
    )
    env = {**os.environ, **TORCHRUN_ENV}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (match,) = VLLM_LINE.findall(proc.stdout)
    result = json.loads(out.read_text())
    assert result.keys() >= VLLM_JSON_KEYS
    assert result["num_requests"] == 6 and result["total_output_tokens"] == 6 * 4
    assert result["total_num_tokens"] == 6 * 12 + 6 * 4  # range ratio 0: exact lengths
    assert float(match[2]) == pytest.approx(24 / result["elapsed_time"], abs=0.006)
    assert float(match[0]) == pytest.approx(result["requests_per_second"], abs=0.006)
    assert result["data_parallel_size"] == 2 and result["enable_dbo"] is True
    assert result["num_ubatched_steps"] > 0 and result["graph_mode"] is False
    assert 0 < result["startup_s"] < 240
    rows = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    assert all(len(r["output_token_ids"]) == 4 for r in rows)
    assert "microbatched" in proc.stdout and "start-up" in proc.stdout
    for rank in (0, 1):  # --profile: the timed run's steps, not the warm-up's
        (trace,) = (tmp_path / "profile").glob(f"rank{rank}.*.pt.trace.json.gz")
        with gzip.open(trace, "rt") as f:
            names = [e.get("name") for e in json.load(f)["traceEvents"]]
        assert result["num_steps"] <= names.count("step") <= result["num_steps"] + 2, rank
        assert "layer0.experts" in names


def test_profile_without_a_profiler_config_fails_before_any_work():
    proc = subprocess.run(
        ["python", "-m", "launch.bench_throughput", "--profile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    expected = '--profile needs --profiler-config, e.g. \'{"profiler": "torch", "torch_prof'
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_plain_python_run_fails_with_one_line():
    """Started with ``python -m`` instead of torchrun: one line naming the missing variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        ["python", "-m", "launch.bench_throughput", "--output-len", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing torchrun environment variables" in lines[0], lines
