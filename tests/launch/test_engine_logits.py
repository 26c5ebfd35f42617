"""Teacher-forced logits over DP+EP ranks: DBO on equals DBO off, and both equal transformers.

Each rank builds engines on the same tiny checkpoint (DBO off, and DBO on with 2, 3 and 4 ubatches,
all with expert parallelism), runs the prefill of its prompts and two greedy decode steps, and
returns the logits of every computed row. The thresholds are lowered so that the DBO engines
microbatch every step (prefill requests are cut across ubatches, some across three). A decode step
too small for N ubatches on some rank runs with fewer (4 ranks: 2 or 3 decodes per rank).
transformers' MixtralForCausalLM, fed the same prompt + generated tokens, gives reference logits.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import (
    expected_transport,
    platform_communicators,
    run_distributed,
)
from tests.helpers.engine import (
    assert_dbo_on_equals_off_equals_reference,
    dbo_test_engine_args,
    run_engine_steps,
)
from tests.helpers.precision import reference_model


def _rank_fn(rank, world_size, model_dir, prompts, backends, dtype):
    from distributed import init_distributed
    from launch.engine.llm_engine import LLMEngine

    groups = init_distributed(  # the engine's transport: shared memory on one host
        data_parallel_size=world_size,
        enable_expert_parallel=True,
        timeout_s=60,
        make_communicator=platform_communicators(60),
    )
    results = {"transport": groups.ep_comm.backend}
    # one spawn for every backend and ubatch count: process start-up dominates the cost
    for backend in backends:
        for num_ubatches in (*NUM_UBATCHES, None):  # None: DBO off
            args = dbo_test_engine_args(
                model_dir,
                world_size,
                num_ubatches is not None,
                all2all_backend=backend,
                dtype=dtype,
                ubatch_size=num_ubatches,
            )
            engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
            results[backend, num_ubatches] = run_engine_steps(
                engine, prompts, groups.dp_rank, groups.dp_size
            )
    return results


NUM_UBATCHES = (2, 3, 4)


def expected_num_ubatches(prompts, world_size: int, num_ubatches: int) -> list[int]:
    """Ubatches of the prefill step and of each decode step (one token per request), as the DP
    vote chooses them: the most, up to ``num_ubatches``, with a real token in each on every rank."""
    from dbo.ubatch_slicing import max_num_ubatches
    from tests.helpers.engine import NUM_DECODE_STEPS

    shares = [prompts[r::world_size] for r in range(world_size)]
    prefill = [sum(len(p) for p in share) for share in shares]
    decode = [len(share) for share in shares]
    return [max_num_ubatches(max(prefill), min(prefill), num_ubatches)] + [
        max_num_ubatches(max(decode), min(decode), num_ubatches)
    ] * NUM_DECODE_STEPS


ALL2ALL_BACKENDS = (
    "all_to_all",
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_dbo_on_equals_off_equals_transformers(tiny_mixtral_dir, tiny_prompts, world_size):
    """Every all-to-all backend, DBO off and on with 2, 3 and 4 ubatches, equals transformers in
    float64; each DBO step ran the ubatches the DP vote allows."""
    per_rank = run_distributed(
        _rank_fn,
        world_size,
        tiny_mixtral_dir,
        tiny_prompts,
        ALL2ALL_BACKENDS,
        "float64",
        timeout_s=400,
    )
    # the engine's default transport on one host: shared memory wherever the C++ kernels build
    assert [r["transport"] for r in per_rank] == [expected_transport()] * world_size
    reference = reference_model(tiny_mixtral_dir)
    cache: dict = {}  # transformers' logits per sequence, computed once for every engine
    for backend in ALL2ALL_BACKENDS:
        for num_ubatches in NUM_UBATCHES:
            expected = expected_num_ubatches(tiny_prompts, world_size, num_ubatches)
            assert [r[backend, num_ubatches][2] for r in per_rank] == [expected] * world_size
            assert_dbo_on_equals_off_equals_reference(
                [r[backend, num_ubatches] for r in per_rank],
                [r[backend, None] for r in per_rank],
                reference,
                tiny_prompts,
                label=f"{backend}, {num_ubatches} ubatches",
                model_type="mixtral",
                cache=cache,
            )
    # N ubatches were used where the step allowed, fewer where a decode step was too small
    assert expected_num_ubatches(tiny_prompts, 2, 4) == [4, 4, 4]
    assert expected_num_ubatches(tiny_prompts, 4, 4) == [4, 2, 2]
