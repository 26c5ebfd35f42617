"""launch.benchmarks.peer_table: --engines runs only the engines named, --vllm-results reuses an
earlier run's vLLM figures and tokens, and the row compares ours with vLLM's tokens.

vLLM itself is never run here: a stand-in runner script prints the line ``run_vllm.py`` prints and
writes its tokens file, and ``run_ours`` is replaced by a function returning fixed results.
"""

from __future__ import annotations

import json
import sys

import pytest

from launch.benchmarks import peer_table

FAKE_RUNNER = """
import argparse, json
p = argparse.ArgumentParser()
for flag in ("--model", "--prompts", "--max-tokens", "--threads", "--dtype", "--repeats",
             "--output-json"):
    p.add_argument(flag)
p.add_argument("--compile", action="store_true")
a = p.parse_args()
rate = {"0": 100.0, "0-1": 150.0}[a.threads] + (10.0 if a.compile else 0.0)
json.dump([[1, 2], [3, 4]], open(a.output_json, "w"))
print(f"vllm-cpu: 2 prompts, 4 tokens generated in 0.04 s ({rate} tokens/s); runs [0.04]")
"""


def _argv(tmp_path, out_dir, *extra):
    runner = tmp_path / "fake_run_vllm.py"
    runner.write_text(FAKE_RUNNER)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6]}\n{"prompt_token_ids": [7]}\n')
    return [
        "--vllm-python",
        sys.executable,
        "--vllm-runner",
        str(runner),
        "--out-dir",
        str(out_dir),
        "--checkpoint",
        f"tiny={tmp_path}:{prompts}",
        "--dtypes",
        "float32",
        "--repeats",
        "1",
        *extra,
    ]


def test_vllm_only_then_ours_against_it(tmp_path, monkeypatch, capsys):
    def fake_ours(ns, model, prompts, dtype, *, ranks, eager, tag):
        return {"tokens_per_s": 120.0 * ranks + (0 if eager else 5), "tokens": [[1, 2], [3, 9]]}

    monkeypatch.setattr(peer_table, "run_ours", fake_ours)
    assert peer_table.main(_argv(tmp_path, tmp_path / "v", "--engines", "vllm")) == 0
    (row,) = json.loads((tmp_path / "v" / "table.json").read_text())
    assert row["vllm_eager"]["tokens_per_s"] == 100.0
    assert row["vllm_compiled"]["tokens_per_s"] == 110.0
    assert row["vllm_2threads"]["tokens_per_s"] == 150.0
    assert row["ours_eager"] == {"skipped": True}

    earlier = str(tmp_path / "v" / "table.json")
    monkeypatch.setattr(peer_table, "run_vllm", lambda *a, **k: pytest.fail("vLLM ran again"))
    argv = _argv(tmp_path, tmp_path / "o", "--engines", "ours", "--vllm-results", earlier)
    assert peer_table.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    # ours best 1 rank 125 vs vLLM best 110; 2 ranks 245 vs 150; tokens: 1 of 2 prompts equal
    assert lines[-1] == (
        "| tiny, float32 | 100.0 / 110.0 | 120.0 / 125.0 | 1.14x | 150.0 | 240.0 / 245.0 "
        "| 1.63x | 1/2 |"
    )


def test_rejects_unknown_engine(tmp_path, capsys):
    with pytest.raises(SystemExit):
        peer_table.main(_argv(tmp_path, tmp_path / "x", "--engines", "sglang"))
    assert "--engines takes 'vllm', 'ours' or both, got 'sglang'" in capsys.readouterr().err


def test_cpu_isa_avx2_runs_vllm_as_on_an_avx2_only_cpu(tmp_path, monkeypatch):
    """``--cpu-isa avx2``: vLLM's process sees torch's AVX-512 and AMX probes off (the
    ``avx2_peer`` sitecustomize, as vLLM reads them to pick its kernel build) and oneDNN and torch
    capped; ours gets the same caps and our kernels' ``MOE_DBO_CPU_ISA``; native adds nothing."""
    checking_runner = (
        "import os, torch\n"
        "assert not torch.cpu._is_avx512_supported()\n"
        "assert not torch.cpu._is_avx512_bf16_supported()\n"
        "assert not torch.cpu._is_amx_tile_supported()\n"
        "assert os.environ['ONEDNN_MAX_CPU_ISA'] == 'AVX2'\n"
        "assert torch.backends.cpu.get_cpu_capability() in ('AVX2', 'DEFAULT')\n" + FAKE_RUNNER
    )
    argv = _argv(tmp_path, tmp_path / "out", "--engines", "vllm", "--cpu-isa", "avx2")
    monkeypatch.setattr(peer_table, "run_ours", lambda *a, **k: pytest.fail("ours ran"))
    runner_index = argv.index("--vllm-runner") + 1
    argv[runner_index] = str(tmp_path / "checking_run_vllm.py")
    (tmp_path / "checking_run_vllm.py").write_text(checking_runner)
    assert peer_table.main(argv) == 0
    (row,) = json.loads((tmp_path / "out" / "table.json").read_text())
    assert row["vllm_eager"]["tokens_per_s"] == 100.0, row
    ours = peer_table.cpu_isa_env("avx2", "ours")
    assert ours == {**peer_table.AVX2_CAPS, "MOE_DBO_CPU_ISA": "avx2"}
    assert peer_table.AVX2_CAPS["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert (
        peer_table.cpu_isa_env("native", "ours") == peer_table.cpu_isa_env("native", "vllm") == {}
    )
