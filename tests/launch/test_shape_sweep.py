"""launch.benchmarks.shape_sweep and its grid (launch.benchmarks.shape_grid).

The grid: it spans the ranges the sweep promises, every shape's config loads in our engine, and
each shape scaled down to hidden 64 gives transformers' float64 logits. The table: rows, ratios
and the worst line from fixed numbers and from a stand-in vLLM runner (vLLM itself is never run
here). End to end: the ``small`` grid on ours only, through the real subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from launch.benchmarks import peer_table, shape_sweep  # noqa: E402
from launch.benchmarks.shape_grid import (  # noqa: E402
    DEFAULT_GRID,
    FAMILIES,
    SMALL_GRID,
    Shape,
    ensure_checkpoint,
    hf_model,
)
from moe import build_model, load_checkpoint, load_config  # noqa: E402
from tests.helpers.attention_metadata import BLOCK_SIZE, make_paged_metadata  # noqa: E402
from tests.helpers.precision import (  # noqa: E402
    assert_equals_transformers,
    reference_model,
)

ALL_SHAPES = DEFAULT_GRID + SMALL_GRID
MODEL_TYPES = {"mixtral": "mixtral", "qwen2moe": "qwen2_moe", "deepseekv3": "deepseek_v3"}


def test_default_grid_spans_the_promised_ranges():
    g = DEFAULT_GRID
    assert {s.family for s in g} == set(MODEL_TYPES)
    assert (min(s.num_experts for s in g), max(s.num_experts for s in g)) == (8, 64)
    assert (min(s.top_k for s in g), max(s.top_k for s in g)) == (2, 8)
    assert (min(s.hidden_size for s in g), max(s.hidden_size for s in g)) == (64, 2048)
    assert min(s.prompt_len[0] for s in g) == 8 and max(s.prompt_len[1] for s in g) == 512
    assert 8 <= len(g) <= 12 and len(SMALL_GRID) == 2
    names = [s.name for s in ALL_SHAPES]
    assert len(set(names)) == len(names)
    assert "qwen2moe-e60-k4-h512-p256" in names


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(family="llama"), "family 'llama' is not one of"),
        (dict(top_k=9), "top_k 9 > num_experts 8"),
        (dict(num_heads=4), "whole head of >= 32"),
        (dict(num_kv_heads=3, num_heads=2), "num_kv_heads 3 must divide 2"),
        (dict(prompt_len=(9, 8)), r"prompt_len must be 1 <= min <= max"),
        (dict(vocab_size=0), "vocab_size must be >= 1, got 0"),
    ],
)
def test_shape_rejects_bad_values(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL_GRID[0], **change)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: s.name)
def test_every_shape_config_loads_in_our_engine(tmp_path, shape):
    hf_model(shape, device="meta").config.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.architecture == f"{FAMILIES[shape.family]}ForCausalLM"
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok) == (
        shape.hidden_size,
        shape.num_experts,
        shape.top_k,
    )
    assert config.moe_intermediate_size == shape.moe_intermediate_size
    assert config.num_hidden_layers == shape.num_layers and config.vocab_size == shape.vocab_size
    assert config.attention_type == ("mla" if shape.family == "deepseekv3" else "gqa")
    build_model(config, device="meta")


def _scaled_down(shape: Shape) -> Shape:
    """The shape at hidden 64 (2 heads of 32), experts of 32, vocabulary 128: seconds to build."""
    kv_heads = 1 if shape.num_kv_heads < shape.num_heads else 2
    return dataclasses.replace(
        shape,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=kv_heads,
        moe_intermediate_size=32,
        vocab_size=128,
    )


@pytest.mark.parametrize("shape", DEFAULT_GRID, ids=lambda s: s.name)
def test_each_shape_scaled_down_matches_transformers(tmp_path, shape):
    tiny = _scaled_down(shape)
    model_dir, prompts = ensure_checkpoint(tiny, tmp_path, num_prompts=2)
    ids = torch.tensor(json.loads(prompts.read_text().splitlines()[0])["prompt_token_ids"][:12])
    with torch.no_grad():
        expected = reference_model(model_dir)(input_ids=ids[None]).logits[0]
    ours = build_model(load_config(model_dir), dtype=torch.float64)
    load_checkpoint(ours, model_dir)
    ours.allocate_kv_caches(8, BLOCK_SIZE)
    n = len(ids)
    metadata = make_paged_metadata([n], [n], [list(range(-(-n // BLOCK_SIZE)))])
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(n), metadata))
    assert_equals_transformers(logits, expected, model_type=MODEL_TYPES[tiny.family])


def test_checkpoint_is_cached_until_the_shape_changes(tmp_path):
    shape = SMALL_GRID[0]
    model_dir, prompts = ensure_checkpoint(shape, tmp_path, num_prompts=3)
    weights = model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_checkpoint(shape, tmp_path, num_prompts=3) == (model_dir, prompts)
    assert weights.stat().st_mtime_ns == stamp
    lines = [json.loads(line)["prompt_token_ids"] for line in prompts.read_text().splitlines()]
    assert len(lines) == 3 and all(8 <= len(p) <= 16 and min(p) >= 3 for p in lines)
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] is None
    changed = dataclasses.replace(shape, num_layers=3)  # same name, other weights
    assert changed.name == shape.name
    ensure_checkpoint(changed, tmp_path, num_prompts=3)
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 3


def _row(shape, dtype, ours, vllm, tokens=((1, 2), (3, 4))):
    return {
        "shape": shape,
        "dtype": dtype,
        "ours": {"tokens_per_s": ours, "tokens": [list(t) for t in tokens]},
        "vllm": vllm,
    }


def test_rows_and_worst_line_from_fixed_numbers(tmp_path):
    log = tmp_path / "x.failed.log"
    log.write_text("Traceback ...\n  raise NotImplementedError\nNotImplementedError: MLA | CPU\n")
    rows = [
        _row("a", "float32", 150.0, {"tokens_per_s": 100.0, "tokens": [[1, 2], [3, 5]]}),
        _row("b", "bfloat16", 90.0, {"tokens_per_s": 100.0, "tokens": [[1, 2], [3, 4]]}),
        _row("c", "float32", 10.0, {"error": "tail", "log": str(log)}),
        _row("d", "float32", 10.0, {"absent": "no --vllm-python given"}),
    ]
    assert [shape_sweep.format_row(r) for r in rows] == [
        "| a | float32 | 150.0 | 100.0 | 1.50x | 1/2 |",
        "| b | bfloat16 | 90.0 | 100.0 | 0.90x | 2/2 |",
        "| c | float32 | 10.0 | failed: NotImplementedError: MLA / CPU | - | - |",
        "| d | float32 | 10.0 | absent | - | - |",
    ]
    assert shape_sweep.worst_line(rows) == "worst: b bfloat16 0.90x"
    assert shape_sweep.worst_line(rows[2:]) == "worst: - (no shape has both engines' rates)"
    assert shape_sweep.error_summary({"error": "last words\n"}) == "last words"


def test_error_summary_finds_the_root_error_in_a_vllm_log(tmp_path):
    log = tmp_path / "vllm.failed.log"
    log.write_text(
        "(MainProcess) WARNING 11-27 [base.py:380] ValueError: Tokenizer not available\n"
        "(Worker) ERROR 11-27 [multiproc_executor.py:953]     param = params_dict[name]\n"
        "(Worker) ERROR 11-27 [multiproc_executor.py:953] KeyError: 'layers.1.mlp.gate.bias'\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
        "vllm.v1.engine.exceptions.EngineDeadError: See stack trace (above) for the root cause.\n"
    )
    summary = shape_sweep.error_summary({"error": "tail", "log": str(log)})
    assert summary == "KeyError: 'layers.1.mlp.gate.bias'"


FAKE_RUNNER = """
import argparse, json, sys
p = argparse.ArgumentParser()
for flag in ("--model", "--prompts", "--max-tokens", "--threads", "--dtype", "--repeats",
             "--output-json"):
    p.add_argument(flag)
a = p.parse_args()
assert a.threads == "0"
if "deepseek" in a.model:
    sys.exit("ValueError: no MLA backend on this platform")
n = sum(1 for line in open(a.prompts) if line.strip())
json.dump([[7] * int(a.max_tokens)] * n, open(a.output_json, "w"))
rate = 200.0 if a.dtype == "float32" else 50.0
print(f"vllm-cpu: {n} prompts, 8 tokens generated in 0.04 s ({rate} tokens/s); runs [0.04]")
"""


def test_sweep_with_a_stand_in_vllm(tmp_path, monkeypatch, capsys):
    runner = tmp_path / "fake_run_vllm.py"
    runner.write_text(FAKE_RUNNER)

    def fake_ours(ns, model, prompts, dtype, *, ranks, eager, tag):
        assert (ranks, eager) == (1, True) and Path(model, "config.json").exists()
        return {"tokens_per_s": 100.0, "tokens": [[7] * ns.max_tokens] * ns.num_prompts}

    monkeypatch.setattr(shape_sweep, "run_ours", fake_ours)
    monkeypatch.setattr(shape_sweep, "vllm_absence", lambda python: None)
    argv = ["--out-dir", str(tmp_path / "out"), "--grid", "small", "--num-prompts", "3"]
    argv += ["--max-tokens", "2", "--repeats", "1", "--vllm-python", sys.executable]
    assert shape_sweep.main([*argv, "--vllm-runner", str(runner)]) == 0
    out = capsys.readouterr().out.splitlines()
    mixtral, deepseek = SMALL_GRID[0].name, SMALL_GRID[1].name
    assert f"| {mixtral} | float32 | 100.0 | 200.0 | 0.50x | 3/3 |" in out
    assert f"| {mixtral} | bfloat16 | 100.0 | 50.0 | 2.00x | 3/3 |" in out
    expected = f"| {deepseek} | float32 | 100.0 | failed: ValueError: no MLA backend on this "
    assert any(line.startswith(expected) for line in out)
    assert out[-1] == f"worst: {mixtral} float32 0.50x"
    summary = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["ratio"] for r in summary["rows"]] == [0.5, 2.0, None, None]
    assert summary["rows"][2]["vllm"]["summary"] == "ValueError: no MLA backend on this platform"
    assert summary["worst"] == out[-1] and summary["vllm_absent"] is None
    assert "tokens" not in summary["rows"][0]["ours"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "nope"], "--only: nope not in the small grid"),
        (["--dtype", "float16"], "--dtype takes float32,bfloat16"),
        (["--vllm-python", "python"], "--vllm-python needs --vllm-runner"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ],
)
def test_rejects_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        shape_sweep.main(["--out-dir", str(tmp_path), "--grid", "small", *argv])
    assert message in capsys.readouterr().err


def test_peer_table_helpers_are_the_ones_used():
    assert shape_sweep.run_ours is peer_table.run_ours
    assert shape_sweep.run_vllm is peer_table.run_vllm


@pytest.mark.slow
def test_small_grid_end_to_end_on_ours_only(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch.benchmarks.shape_sweep", "--out-dir", str(out)]
    cmd += ["--grid", "small", "--dtype", "float32", "--repeats", "1"]
    cmd += ["--num-prompts", "4", "--max-tokens", "3"]
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "vLLM column absent: no --vllm-python given" in proc.stdout
    summary = json.loads((out / "sweep.json").read_text())
    assert [r["shape"] for r in summary["rows"]] == [s.name for s in SMALL_GRID]
    for row in summary["rows"]:
        assert row["ours"]["tokens_per_s"] > 0, row
        tokens = (out / f"{row['shape']}_float32_ours.tokens.jsonl").read_text().splitlines()
        assert len(tokens) == 4 and all(len(json.loads(t)["output_token_ids"]) == 3 for t in tokens)
    assert proc.stdout.splitlines()[-1] == "worst: - (no shape has both engines' rates)"
