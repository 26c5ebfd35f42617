"""One request's failure fails that request alone; the engine keeps stepping in DP lockstep.

Two DP ranks with expert parallelism and DBO (every step microbatched) run 32 normal requests
(greedy and seeded sampling) twice: alone, and beside "poison" requests — one whose sampling raises
(injected into the sampler), one at temperature 1e-300 (vLLM's rule: greedy). Every normal request
must get the same tokens both times, the injected one must end with its error, the tiny-temperature
one must equal its greedy twin, every KV block must be free afterwards, and the engine must serve a
request after that. float64, so that batch composition changes no token.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers.distributed import run_distributed

NUM_NORMAL = 32
INJECTED = 100  # its sampling raises
INJECTED_SEED = 987_654_321  # the sampler raises on a batch holding a row with this seed
TINY_TEMPERATURE = 101  # temperature 1e-300 in the poisoned run, 0 in the clean one
AFTER = 102  # submitted after the poisoned run


def _requests(poisoned: bool) -> list[tuple[int, list[int], float, int | None]]:
    """(request_id, prompt, temperature, seed) of every request."""
    rng = random.Random(5)
    out = []
    for i in range(NUM_NORMAL):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randint(2, 12))]
        out.append((i, prompt, 0.0 if i % 2 else 0.8, None if i % 4 else 1000 + i))
    out.append((TINY_TEMPERATURE, [7, 8, 9], 1e-300 if poisoned else 0.0, None))
    if poisoned:
        out.append((INJECTED, [10, 11], 0.7, INJECTED_SEED))
    return out


def _run(engine, rank: int, requests) -> dict[int, tuple]:
    from launch.engine.request import Request, SamplingParams

    for request_id, prompt, temperature, seed in requests:
        if request_id % 2 != rank:
            continue  # ids are spread over the two DP ranks
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=seed)
        engine.add_request(
            Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
        )
    finished = engine.run_until_done()
    return {r.request_id: (r.output_token_ids, r.finish_reason, r.error) for r in finished}


def _rank_fn(rank, world_size, model_dir):
    from distributed import init_distributed
    from launch.engine.llm_engine import LLMEngine
    from tests.helpers.engine import dbo_test_engine_args

    groups = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=True, timeout_s=60
    )
    results = {}
    for poisoned in (False, True):
        args = dbo_test_engine_args(model_dir, world_size, enable_dbo=True, dtype="float64")
        engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
        if poisoned:
            sampler = engine.model_runner.sampler

            def failing_sampler(logits, metadata, sampler=sampler):
                if bool(((metadata.seeds == INJECTED_SEED) & (metadata.temperature > 0)).any()):
                    raise RuntimeError("injected sampling failure")
                return sampler(logits, metadata)

            engine.model_runner.sampler = failing_sampler
        results[poisoned] = _run(engine, rank, _requests(poisoned))
        results[poisoned, "ubatched"] = engine.observability.stats.num_ubatched_steps
        if poisoned:
            kv = engine.kv_cache_manager
            results["free_blocks"] = (kv.num_free_blocks, kv.num_blocks)
            results["after"] = _run(engine, rank, [(AFTER, [7, 8, 9], 0.0, None)])
    return results


@pytest.mark.slow
def test_a_poisoned_request_fails_alone_and_the_engine_keeps_stepping(tiny_mixtral_dir):
    per_rank = run_distributed(_rank_fn, 2, tiny_mixtral_dir, timeout_s=240)
    clean = {k: v for r in per_rank for k, v in r[False].items()}
    poisoned = {k: v for r in per_rank for k, v in r[True].items()}
    assert all(r[True, "ubatched"] > 0 for r in per_rank)  # DBO engaged
    for request_id in range(NUM_NORMAL):
        assert poisoned[request_id] == clean[request_id], request_id
        assert clean[request_id][1] in ("length", "stop") and clean[request_id][2] is None
    tokens, reason, error = poisoned[INJECTED]
    assert reason == "error" and tokens == []
    assert error == "sampling failed: RuntimeError: injected sampling failure"
    assert poisoned[TINY_TEMPERATURE] == clean[TINY_TEMPERATURE]  # 1e-300 is greedy
    for rank_result in per_rank:
        free, total = rank_result["free_blocks"]
        assert free == total  # the failed request's blocks were freed
    after = {k: v for r in per_rank for k, v in r["after"].items()}
    assert after[AFTER] == clean[TINY_TEMPERATURE]  # same prompt, greedy
