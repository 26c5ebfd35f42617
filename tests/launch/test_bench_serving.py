"""The load generator's statistics and argument checks (its runs against a server live in
test_serve_e2e.py)."""

import numpy as np
import pytest

from launch.bench_serving import BenchResult, main, percentile
from launch.benchmarks.serving import arrival_gaps, random_requests


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(range(101))])
@pytest.mark.parametrize("q", [50, 90, 99, 99.9])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_rows_report_ms_and_throughput():
    result = BenchResult(
        num_ok=4,
        num_failed=1,
        duration_s=2.0,
        num_output_tokens=40,
        num_input_tokens=20,
        ttft_s=(0.1, 0.2, 0.3, 0.4),
        itl_s=(0.01, 0.03),
        ubatched_step_fraction=0.5,
    )
    rows = result.rows()
    assert rows["requests ok / failed"] == "4 / 1"
    assert rows["output throughput (tok/s)"] == "20.0"
    assert rows["total throughput (tok/s)"] == "30.0"
    assert rows["TTFT median (ms)"] == "250.0"
    assert rows["ITL median (ms)"] == "20.0"
    assert rows["steps microbatched (%)"] == "50"


def test_non_loopback_url_is_refused(capsys):
    assert main(["--base-url=http://10.0.0.1:8000"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_summary_is_vllm_layout():
    result = BenchResult(
        num_ok=4,
        num_failed=0,
        duration_s=2.0,
        num_output_tokens=40,
        num_input_tokens=20,
        ttft_s=(0.1, 0.2, 0.3, 0.4),
        itl_s=(0.01, 0.03),
        tpot_s=(0.02, 0.04),
        e2el_s=(1.0, 2.0),
        ubatched_step_fraction=None,
    )
    lines = result.summary(metric_percentiles=(50.0, 99.0), max_concurrency=8).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     4         "
    assert "Maximum request concurrency:             8         " in lines
    assert "Benchmark duration (s):                  2.00      " in lines
    assert "Request throughput (req/s):              2.00      " in lines
    assert "Output token throughput (tok/s):         20.00     " in lines
    assert "Total Token throughput (tok/s):          30.00     " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "Mean TTFT (ms):                          250.00    " in lines
    assert "Median TTFT (ms):                        250.00    " in lines
    assert "P50 TTFT (ms):                           250.00    " in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Mean TPOT (ms):                          30.00     " in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "P99 ITL (ms):                            29.80     " in lines
    assert lines[-1] == "=" * 50 and not any("E2EL" in line for line in lines)


def test_random_dataset_lengths_and_prefix():
    requests = random_requests(
        num_prompts=200,
        input_len=20,
        output_len=10,
        range_ratio=0.5,
        prefix_len=3,
        vocab_low=3,
        vocab_high=100,
        seed=1,
    )
    assert {tuple(r.prompt_token_ids[:3]) for r in requests} == {
        tuple(requests[0].prompt_token_ids[:3])
    }
    input_lens = {len(r.prompt_token_ids) - 3 for r in requests}
    assert min(input_lens) == 10 and max(input_lens) == 30
    assert {r.output_len for r in requests} == set(range(5, 16))
    assert all(3 <= t < 100 for r in requests for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match=r"--random-range-ratio must be in \[0, 1\)"):
        random_requests(
            num_prompts=1,
            input_len=2,
            output_len=2,
            range_ratio=1.0,
            prefix_len=0,
            vocab_low=3,
            vocab_high=100,
            seed=1,
        )


def test_poisson_gaps_have_the_requested_mean():
    gaps = arrival_gaps(4000, request_rate=20.0, burstiness=1.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert arrival_gaps(3, request_rate=float("inf"), burstiness=1.0, seed=0) == [0.0] * 3


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--percentile-metrics=ttft,foo"], "--percentile-metrics"),
        (["--metric-percentiles=50,x"], "--metric-percentiles"),
        (["--endpoint=/v1/chat/completions"], "--endpoint must be /v1/completions"),
        (["--random-input-len=0"], "--random-input-len must be >= 1"),
        (["--input-len=0"], "--random-input-len must be >= 1"),  # the old spelling
        (["--backend=openai-chat"], "--backend openai-chat needs --tokenizer DIR"),
        (["--backend=openai-chat", "--endpoint=/v1/completions"], "must be /v1/chat/completions"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, argv, pattern):
    assert main(argv) == 2
    assert pattern in capsys.readouterr().err
