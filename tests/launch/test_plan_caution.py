"""``launch.plan``'s asymmetric caution: shapes predicted within the error bar of 1.0x stay below
the recommended thresholds, out of the adaptive policy's prior, and are named in the output."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dbo import Bucket, prior_from_table
from dbo.planning.planner import (
    DEFAULT_ERROR,
    Prediction,
    bucket_prior,
    crossover,
    predict,
    recommend,
    token_sweep,
)
from dbo.planning.report import advice, caution_note, measured_error, prior_table
from launch import plan
from tests.launch.test_plan import sglang_decode_model


def _prediction(speedup: float, kind: str = "decode", num_tokens: int = 64) -> Prediction:
    return Prediction(
        kind=kind,
        num_tokens=num_tokens,
        compute_ms=1.0,
        comm_ms=1.0,
        step_ms_off=10.0,
        step_ms_on={2: 10.0 / speedup},
    )


def test_advice_leaves_dbo_off_within_the_error_of_one():
    assert [advice(_prediction(s)) for s in (1.5, 1.11, 1.05, 0.95, 0.9, 0.7)] == [
        "N=2",
        "N=2",
        "~1: off",
        "~1: off",
        "~1: off",
        "off",
    ]
    # a smaller error bar lets a small predicted gain through, never below the tie tolerance
    assert advice(_prediction(1.05), error=0.02) == "N=2"
    assert advice(_prediction(1.005), error=0.0) == "off"  # below the tie tolerance
    note = caution_note([_prediction(1.05), _prediction(1.5, num_tokens=256)])
    assert note == (
        "within the error (±10 points) of 1.0x: decode:64 (1.05x): leave DBO off "
        "(the adaptive policy decides: thresholds auto)"
    )
    assert caution_note([_prediction(1.5), _prediction(0.5)]) is None


def test_recommended_threshold_clears_the_error_bar():
    model, link = sglang_decode_model()
    sweep = token_sweep(2, 512)
    speedups = {t: predict(model, link, "decode", t, [2]).speedup[2] for t in sweep}
    rec = recommend(model, link, [2], {"decode": 512})["decode"]
    # the predicted crossover is where DBO passes the tie tolerance; the threshold is higher:
    # the predicted gain between them is within the 10-point error bar of 1.0x
    assert rec["crossover"] == crossover(model, link, "decode", [2], sweep) == 96
    assert rec["threshold"] == 128 and rec["num_ubatches"] == 2
    assert all(speedups[t] > 1 + DEFAULT_ERROR for t in sweep if t >= rec["threshold"])
    assert 1.01 < speedups[96] <= 1 + DEFAULT_ERROR
    # no error bar: the threshold is the crossover; a huge one: DBO stays off, N still named
    assert recommend(model, link, [2], {"decode": 512}, error=0.0)["decode"]["threshold"] == 96
    never = recommend(model, link, [2], {"decode": 512}, error=0.9)["decode"]
    assert never == {"crossover": 96, "threshold": None, "num_ubatches": 2}
    with pytest.raises(ValueError, match="error bar must be >= 0, got -0.1"):
        recommend(model, link, [2], {"decode": 512}, error=-0.1)


def test_prior_leaves_out_buckets_within_the_error(tmp_path):
    model, link = sglang_decode_model()
    table = prior_table(model, link)
    assert table["error"] == DEFAULT_ERROR
    everything = prior_table(model, link, error=0.0)
    left_out = set(everything["decode"]) - set(table["decode"])
    assert left_out, "expected a decode bucket predicted near 1.0x"
    for b in everything["decode"]:
        speedup = bucket_prior(model, link, "decode", int(b))
        assert (b in left_out) == (abs(speedup - 1) <= DEFAULT_ERROR)
    # the policy reads a left-out bucket as no prediction: it explores it fully
    prior = prior_from_table(json.loads(json.dumps(table)))
    assert prior(Bucket(kind="decode", log2_tokens=int(min(left_out)))) is None


def test_the_error_bar_comes_from_the_flag_or_the_comparison():
    rows = [{"predicted": 1.2, "measured": 1.0}, {"predicted": 0.9, "measured": 0.95}]
    assert measured_error(rows) == pytest.approx(0.2)
    assert measured_error(rows[1:]) == DEFAULT_ERROR  # 5 points measured: the default stays
    assert measured_error([]) == DEFAULT_ERROR
    assert plan.error_bar(SimpleNamespace(error_points=None), rows) == pytest.approx(0.2)
    assert plan.error_bar(SimpleNamespace(error_points=3.0), rows) == pytest.approx(0.03)


def test_cli_names_the_shapes_left_off(capsys):
    argv = ["--ep-size", "72", "--decode-tokens", "64,96,256", "--prefill-tokens", "4096"]
    assert plan.main([*argv, "--num-ubatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "within the error (±10 points) of 1.0x: decode:64 (0.97x), decode:96 (1.09x)" in out
    assert "crossover decode: DBO pays >= 96 tokens per device, best N at 256: 2" in out
    assert "caution decode: at 96 to <128 tokens per device the predicted gain is within" in out
    assert "recommended: --dbo-decode-token-threshold 128 --dbo-prefill-token-threshold 96" in out
    assert plan.main([*argv, "--num-ubatches", "2", "--error-points", "0"]) == 0
    out = capsys.readouterr().out
    assert "caution" not in out and "within the error" not in out
    assert "recommended: --dbo-decode-token-threshold 96 " in out
