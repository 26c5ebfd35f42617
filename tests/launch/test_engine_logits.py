"""Teacher-forced logits over DP+EP ranks: DBO on equals DBO off, and both equal transformers.

Each rank builds two engines on the same tiny checkpoint (DBO on and off, both with expert
parallelism), runs the prefill of its prompts and two greedy decode steps, and returns the logits
of every computed row. The thresholds are lowered so that the DBO engine microbatches every step
(a prefill request is cut across the two ubatches). transformers' MixtralForCausalLM, fed the same
prompt + generated tokens, gives the reference logits.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.engine import (
    assert_dbo_on_equals_off_equals_reference,
    dbo_test_engine_args,
    run_engine_steps,
)


def _rank_fn(rank, world_size, model_dir, prompts, backends, dtype):
    from distributed import init_distributed
    from launch.engine.llm_engine import LLMEngine, resolve_model

    results = {}
    groups = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=True, timeout_s=60
    )
    # one spawn for every backend: process start-up dominates the cost of this test
    for backend in backends:
        for enable_dbo in (True, False):
            args = dbo_test_engine_args(
                model_dir, world_size, enable_dbo, all2all_backend=backend, dtype=dtype
            )
            engine = LLMEngine(engine_args=args, model=resolve_model(args), groups=groups)
            results[backend, enable_dbo] = run_engine_steps(
                engine, prompts, groups.dp_rank, groups.dp_size
            )
    return results


ALL2ALL_BACKENDS = (
    "all_to_all", "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency"
)  # fmt: skip
# float64 logits of a few units: our engine and transformers differ only by summation order
FLOAT64_ATOL = 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_dbo_on_equals_off_equals_transformers(tiny_mixtral_dir, tiny_prompts, world_size):
    """Every all-to-all backend, DBO on and off, equals transformers in float64."""
    from transformers import MixtralForCausalLM

    per_rank = run_distributed(
        _rank_fn, world_size, tiny_mixtral_dir, tiny_prompts, ALL2ALL_BACKENDS, "float64",
        timeout_s=400,
    )  # fmt: skip
    reference = MixtralForCausalLM.from_pretrained(
        tiny_mixtral_dir,
        dtype=torch.float64,
        experts_implementation="eager",  # no fp64 grouped GEMM
    ).eval()
    for backend in ALL2ALL_BACKENDS:
        assert_dbo_on_equals_off_equals_reference(
            [r[backend, True] for r in per_rank],
            [r[backend, False] for r in per_rank],
            reference,
            tiny_prompts,
            label=backend,
            atol=FLOAT64_ATOL,
        )
