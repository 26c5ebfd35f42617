"""Teacher-forced logits over DP+EP ranks: DBO on equals DBO off, and both equal transformers.

Each rank builds two float64 engines on the same tiny checkpoint (DBO on and off, both with expert
parallelism), runs the prefill of its prompts and two greedy decode steps, and returns the logits
of every computed row. The thresholds are lowered so that the DBO engine microbatches every step
(a prefill request is cut across the two ubatches). transformers' MixtralForCausalLM in float64,
fed the same prompt + generated tokens, gives the reference logits; tolerances in
``tests.helpers.precision`` (float64: 1e-9 of the largest |logit|, on any CPU).
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.engine import (
    assert_dbo_on_equals_off_equals_reference,
    dbo_test_engine_args,
    run_engine_steps,
)
from tests.helpers.precision import FLOAT64_REL, reference_model


def _rank_fn(rank, world_size, model_dir, prompts, backend):
    from distributed import init_distributed
    from launch.engine.llm_engine import LLMEngine, resolve_model

    results = {}
    groups = None
    for enable_dbo in (True, False):
        args = dbo_test_engine_args(model_dir, world_size, enable_dbo, all2all_backend=backend)
        if groups is None:
            groups = init_distributed(
                data_parallel_size=world_size, enable_expert_parallel=True, timeout_s=60
            )
        engine = LLMEngine(engine_args=args, model=resolve_model(args), groups=groups)
        results[enable_dbo] = run_engine_steps(engine, prompts, groups.dp_rank, groups.dp_size)
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "backend"), [(2, "all_to_all"), (4, "allgather_reducescatter")]
)
def test_dbo_on_equals_off_equals_transformers(tiny_mixtral_dir, tiny_prompts, world_size, backend):
    per_rank = run_distributed(
        _rank_fn, world_size, tiny_mixtral_dir, tiny_prompts, backend, timeout_s=240
    )
    assert_dbo_on_equals_off_equals_reference(
        [r[True] for r in per_rank],
        [r[False] for r in per_rank],
        reference_model(tiny_mixtral_dir),
        tiny_prompts,
        reference_rel=FLOAT64_REL,
    )
