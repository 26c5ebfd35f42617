"""The load generator's statistics and argument checks (its runs against a server live in
test_serve_e2e.py)."""

import numpy as np
import pytest

from launch.bench_serving import BenchResult, main, percentile


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(range(101))])
@pytest.mark.parametrize("q", [50, 90, 99])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_rows_report_ms_and_throughput():
    result = BenchResult(
        num_ok=4, num_failed=1, duration_s=2.0, num_output_tokens=40, num_input_tokens=20,
        ttft_s=(0.1, 0.2, 0.3, 0.4), itl_s=(0.01, 0.03), ubatched_step_fraction=0.5,
    )  # fmt: skip
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
