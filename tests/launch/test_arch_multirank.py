"""DeepSeek-V2/V3, Qwen2-MoE and OLMoE on 2 DP ranks with expert parallelism and DBO.

One spawned 2-rank run covers all four architectures (keeps the suite fast): per architecture each
rank builds a DBO engine (thresholds lowered so every step is microbatched) and a plain EP engine,
runs the prefill of its prompts and two greedy decode steps teacher-forced, and returns every logit
row. Float32 logits must equal transformers' float64 ones within a bound derived from float32 (see
``assert_dbo_on_equals_off_equals_reference``) and DBO on must equal DBO off.
The DBO engine records a timeline: each shared-experts span must lie inside the window between its
ubatch issuing the combine and taking its result (its ``combine_window`` span).

The end-to-end case runs ``torchrun -m launch.generate`` per architecture and DeepEP backend (DP=2,
EP, DBO, float32) and compares the greedy tokens with transformers' ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy
from tests.helpers.distributed import platform_communicators, run_distributed
from tests.helpers.engine import (
    assert_dbo_on_equals_off_equals_reference,
    dbo_test_engine_args,
    run_engine_steps,
)
from tests.helpers.generate import DBO_FLAGS, read_outputs, torchrun
from tests.helpers.precision import reference_model

ARCHS = ("deepseek_v2", "deepseek_v3", "qwen2_moe", "olmoe", "qwen3_moe")
NO_SHARED_EXPERTS = ("olmoe", "qwen3_moe")


def _shared_in_combine(spans) -> list[tuple[int, int, int, int]]:
    """(combine issued, shared start, shared end, combine taken) per shared-experts span, from the
    ``combine_window`` span its ubatch records next (issue to taking the result)."""
    pairs = []
    for i, span in enumerate(spans):
        if not span.name.endswith("shared_experts"):
            continue
        ubatch = span.track.split()[0]
        window = next(
            s
            for s in spans[i + 1 :]
            if s.name.endswith("combine_window") and s.track == f"{ubatch} comm"
        )
        pairs.append((window.start_ns, span.start_ns, span.end_ns, window.end_ns))
    return pairs


def _rank_fn(rank, world_size, model_dirs, prompts, timeline_dir):
    from distributed import init_distributed
    from launch.engine.llm_engine import LLMEngine

    groups = init_distributed(  # the engine's transport: shared memory on one host
        data_parallel_size=world_size,
        enable_expert_parallel=True,
        timeout_s=60,
        make_communicator=platform_communicators(60),
    )
    results = {}
    for model_type in ARCHS:
        for enable_dbo in (True, False):
            args = dbo_test_engine_args(
                model_dirs[model_type],
                world_size,
                enable_dbo,
                timeline_dir=timeline_dir if enable_dbo else None,
            )
            engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
            results[model_type, enable_dbo] = run_engine_steps(
                engine, prompts, groups.dp_rank, groups.dp_size
            )
            if enable_dbo:
                results[model_type, "timeline"] = _shared_in_combine(
                    engine.observability.timeline.spans()
                )
                engine.observability.write_timeline()
    return results


@pytest.mark.slow
def test_dp2_ep_dbo_logits_equal_transformers_for_every_architecture(
    tmp_path, tiny_arch_dirs, tiny_prompts
):
    per_rank = run_distributed(
        _rank_fn, 2, tiny_arch_dirs, tiny_prompts, str(tmp_path / "timeline"), timeout_s=280
    )
    for model_type in ARCHS:
        reference = reference_model(tiny_arch_dirs[model_type], torch.float32)
        exact = reference_model(tiny_arch_dirs[model_type])
        assert_dbo_on_equals_off_equals_reference(
            [r[model_type, True] for r in per_rank],
            [r[model_type, False] for r in per_rank],
            reference,
            tiny_prompts,
            label=model_type,
            exact_reference=exact,
        )
        for rank_result in per_rank:
            pairs = rank_result[model_type, "timeline"]
            if model_type not in NO_SHARED_EXPERTS:
                # one per sparse layer (1) per ubatch (2) per step (3)
                assert len(pairs) == 6, pairs
                for issued, shared_start, shared_end, taken in pairs:
                    assert issued <= shared_start <= shared_end <= taken
            else:
                assert pairs == []
    assert (tmp_path / "timeline" / "rank0.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepep_low_latency", "deepep_high_throughput"])
@pytest.mark.parametrize("model_type", ARCHS)
def test_generate_dp2_ep_dbo_greedy_equals_transformers(
    tmp_path, tiny_arch_dirs, tiny_prompts, tiny_prompts_file, model_type, backend
):
    out = tmp_path / "out.jsonl"
    proc = torchrun(
        2,
        f"--model={tiny_arch_dirs[model_type]}",
        f"--prompts={tiny_prompts_file}",
        f"--output={out}",
        "--max-tokens=8",
        "--data-parallel-size=2",
        f"--all2all-backend={backend}",
        *DBO_FLAGS,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "B/token" in proc.stdout and "routed_experts" in proc.stdout, proc.stdout
    config = json.loads(Path(tiny_arch_dirs[model_type], "config.json").read_text())
    reference = reference_model(tiny_arch_dirs[model_type], torch.float32)
    expected = hf_greedy(reference, tiny_prompts, eos_token_id=config["eos_token_id"])
    assert [r["output_token_ids"] for r in read_outputs(out)] == expected
