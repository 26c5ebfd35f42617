"""End to end through torchrun: greedy DBO generation equals transformers; bad input fails fast.

Each case launches ``torchrun -m launch.generate`` as a user would. The DBO thresholds are lowered
so that the tiny batches are microbatched, and the summary line must report microbatched steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.chat import build_chat_tokenizer
from tests.helpers.generate import DBO_FLAGS, read_outputs, torchrun

ERROR_LINE = re.compile(r"^launch\.generate( \[rank \d+\])?: error: ")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "backend", "balance"),
    [
        (2, "all_to_all", "shortest_queue"),
        (2, "allgather_reducescatter", "shortest_queue"),
        (4, "all_to_all", "minimum_tokens"),
        (4, "allgather_reducescatter", "shortest_queue"),
        (2, "deepep_high_throughput", "shortest_queue"),
        (2, "deepep_low_latency", "minimum_tokens"),
        (4, "deepep_high_throughput", "shortest_queue"),
        (4, "deepep_low_latency", "round_robin"),
    ],
)
def test_greedy_dbo_generation_equals_transformers(
    tmp_path,
    tiny_mixtral_dir,
    tiny_prompts,
    tiny_prompts_file,
    transformers_greedy,
    nproc,
    backend,
    balance,
):
    out = tmp_path / "out.jsonl"
    proc = torchrun(
        nproc,
        f"--model={tiny_mixtral_dir}",
        f"--prompts={tiny_prompts_file}",
        f"--output={out}",
        "--max-tokens=8",
        f"--data-parallel-size={nproc}",
        f"--all2all-backend={backend}",
        f"--load-balance-method={balance}",
        *DBO_FLAGS,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = read_outputs(out)
    assert [r["index"] for r in results] == list(range(len(tiny_prompts)))
    assert [r["prompt_token_ids"] for r in results] == tiny_prompts
    assert [r["output_token_ids"] for r in results] == transformers_greedy
    summary = re.search(r"(\d+) steps, (\d+) microbatched", proc.stdout)
    assert summary, proc.stdout
    assert int(summary.group(2)) > 0, proc.stdout
    # the start-up line and the summary name the backend and what runs it (no CUDA here)
    expected = "torch.distributed emulation of DeepEP's protocol"
    if not backend.startswith("deepep"):
        expected = "torch.distributed"
    assert proc.stdout.count(f"expert all-to-all: {backend} ({expected})") == 1, proc.stdout
    assert f"all2all {backend} ({expected})" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_adaptive_dbo_generation_equals_transformers(
    tmp_path, tiny_mixtral_dir, tiny_prompts, tiny_prompts_file, transformers_greedy
):
    """``auto`` thresholds: the policy explores both arms (off, on, on, off, ...) while generating;
    the tokens must equal transformers' greedy ones (which DBO off and DBO on also equal)."""
    out = tmp_path / "out.jsonl"
    proc = torchrun(
        2,
        f"--model={tiny_mixtral_dir}",
        f"--prompts={tiny_prompts_file}",
        f"--output={out}",
        "--max-tokens=8",
        "--data-parallel-size=2",
        "--dtype=float32",
        "--enable-expert-parallel",
        "--enable-dbo",
        "--dbo-decode-token-threshold=auto",
        "--dbo-prefill-token-threshold=auto",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["output_token_ids"] for r in read_outputs(out)] == transformers_greedy
    summary = re.search(r"(\d+) steps, (\d+) microbatched", proc.stdout)
    assert summary and 0 < int(summary.group(2)) < int(summary.group(1)), proc.stdout
    crossover = re.search(
        r"adaptive DBO crossover: decode (>= \d+ tokens|never|unknown), "
        r"prefill (>= \d+ tokens|never|unknown) \((\d+) exploration steps\)",
        proc.stdout,
    )
    assert crossover and int(crossover.group(3)) > 0, proc.stdout


@pytest.mark.slow
def test_fewer_prompts_than_ranks(tmp_path, tiny_chat_dir, tiny_prompts, transformers_greedy):
    """One text prompt (the checkpoint has a tokenizer) on 2 ranks: the output line carries the
    prompt, its ids and the text of transformers' greedy continuation."""
    prompts = tmp_path / "one.jsonl"
    text = " ".join(f"<{t}>" for t in tiny_prompts[3])
    prompts.write_text(json.dumps({"prompt": text}) + "\n")
    out = tmp_path / "out.jsonl"
    proc = torchrun(
        2,
        f"--model={tiny_chat_dir}",
        f"--prompts={prompts}",
        f"--output={out}",
        "--max-tokens=8",
        "--data-parallel-size=2",
        *DBO_FLAGS,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected_text = build_chat_tokenizer().decode(transformers_greedy[3], skip_special_tokens=True)
    assert read_outputs(out) == [
        {
            "index": 0,
            "prompt": text,
            "prompt_token_ids": tiny_prompts[3],
            "output_token_ids": transformers_greedy[3],
            "text": expected_text,
        }
    ]


def _bad_input_cases(tmp_path: Path, model_dir: str, prompts_file: str):
    text_prompt = tmp_path / "text.jsonl"
    text_prompt.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt_token_ids": [5] * 40}) + "\n")
    nested = tmp_path / "nested.jsonl"  # issue 28 case 7: RecursionError in json.loads
    nested.write_text('{"prompt_token_ids": [1]}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(Path(model_dir, "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    dp2 = ("--data-parallel-size=2",)
    return {
        "dbo_one_rank": (
            1,
            ("--enable-dbo", "--enable-expert-parallel"),
            r"--enable-dbo needs --data-parallel-size >= 2",
        ),
        "dbo_without_ep": (
            2,
            (*dp2, "--enable-dbo"),
            r"--enable-dbo needs --enable-expert-parallel",
        ),
        "dp_mismatch": (
            2,
            ("--data-parallel-size=4",),
            r"--data-parallel-size 4 does not match the 2 rank",
        ),
        "missing_checkpoint": (
            2,
            (*dp2, f"--model={tmp_path / 'nope'}"),
            r"no such checkpoint directory",
        ),
        "corrupt_checkpoint": (2, (*dp2, f"--model={corrupt}"), r"model.safetensors"),
        "unsupported_arch": (
            2,
            (*dp2, f"--model={unsupported}"),
            r"supported architectures: \['DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM', "
            r"'MixtralForCausalLM', 'OlmoeForCausalLM', "
            r"'Qwen2MoeForCausalLM', 'Qwen3MoeForCausalLM'\]",
        ),
        "prompt_too_long": (
            2,
            (*dp2, f"--model={model_dir}", f"--prompts={long_prompt}", "--max-model-len=32"),
            r"prompt 0 has 40 tokens; with max_model_len 32 \(--max-model-len\)",
        ),
        "text_without_tokenizer": (
            2,
            (*dp2, f"--model={model_dir}", f"--prompts={text_prompt}"),
            r"text prompts need a tokenizer and \S+/tokenizer\.json does not exist",
        ),
        "deeply_nested_prompt_line": (
            2,
            (*dp2, f"--model={model_dir}", f"--prompts={nested}"),
            r"nested.jsonl:2: expected a JSON object .*JSON nested too deeply",
        ),
        "unknown_backend": (2, (*dp2, "--all2all-backend=nvshmem"), r"invalid choice: 'nvshmem'"),
        # checked before any work (these failed after the process group started, or at the end)
        "output_not_writable": (
            2,
            (*dp2, "--output=/proc/nonexist/out.jsonl"),
            r"--output '/proc/nonexist/out.jsonl' is not writable",
        ),
        "timeline_not_writable": (
            2,
            (*dp2, "--timeline-dir=/proc/nonexist"),
            r"--timeline-dir '/proc/nonexist' is not writable",
        ),
        "temperature_nan": (
            2,
            (*dp2, "--temperature=nan"),
            r"temperature must be a finite number >= 0 \(below 1e-05 means greedy\), got nan",
        ),
        "seed_overflow": (
            2,
            (*dp2, "--seed=18446744073709551616"),
            r"--seed must be in \[-2\*\*63, 2\*\*63 - 1\] .*got 18446744073709551616",
        ),
        "distributed_timeout_inf": (
            2,
            (*dp2, "--distributed-timeout=inf"),
            r"--distributed-timeout must be in \(0, 86400\] s, got inf",
        ),
    }


CASES = [
    "dbo_one_rank",
    "dbo_without_ep",
    "dp_mismatch",
    "missing_checkpoint",
    "corrupt_checkpoint",
    "unsupported_arch",
    "prompt_too_long",
    "deeply_nested_prompt_line",
    "text_without_tokenizer",
    "unknown_backend",
    "output_not_writable",
    "timeline_not_writable",
    "temperature_nan",
    "seed_overflow",
    "distributed_timeout_inf",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_ends_every_rank_with_one_line(
    tmp_path, tiny_mixtral_dir, tiny_prompts_file, case
):
    """Every rank that gets as far as validating prints the same one-line error and exits non-zero.

    torchrun's agent stops the other ranks as soon as one exits, so a rank still importing may be
    ended by that SIGTERM before it prints: count at least one line, never a mismatching one.
    """
    nproc, args, pattern = _bad_input_cases(tmp_path, tiny_mixtral_dir, tiny_prompts_file)[case]
    proc = torchrun(nproc, *args, timeout=60)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if ERROR_LINE.match(line)]
    assert 1 <= len(errors) <= nproc, proc.stderr[-3000:]
    ranks = [m.group(1) for m in map(re.compile(r"\[rank (\d+)\]").search, errors) if m]
    assert len(ranks) == len(set(ranks)), errors  # one line per rank, no rank twice
    for line in errors:
        assert re.search(pattern, line), line
    # no rank's traceback (torchrun's own ChildFailedError traceback is the launcher's)
    assert not re.search(r"RecursionError|File .*/launch/", proc.stderr), proc.stderr[-3000:]


def test_a_text_line_too_long_to_fit_is_one_line_before_tokenizing(tmp_path, tiny_chat_dir):
    """Issue 35 case 2: a 10 MB text line was tokenized before its length was checked (1.56 GiB
    per rank); now its bytes are checked first (``launch.text.text_bound``)."""
    prompts = tmp_path / "long_text.jsonl"
    text = "<5> " * 500_000
    prompts.write_text(
        json.dumps({"prompt": "<5> <6>"}) + "\n" + json.dumps({"prompt": text}) + "\n"
    )
    proc = torchrun(
        2, f"--model={tiny_chat_dir}", f"--prompts={prompts}", "--data-parallel-size=2", timeout=60
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if ERROR_LINE.match(line)]
    assert 1 <= len(errors) <= 2, proc.stderr[-3000:]
    for line in errors:
        assert re.search(
            r"error: prompt 1 has 2000000 bytes of text; with max_model_len 128 .* at most 8128 "
            r"bytes .*; refused before tokenizing$",
            line,
        ), line
