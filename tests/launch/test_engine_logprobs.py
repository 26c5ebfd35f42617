"""Logprobs from the engine (2 DP ranks, EP, DBO): equal to transformers' log_softmax in float64 on
prompt + generated tokens, present only for the requests that asked, and top-p sampling stays in
the nucleus that transformers' probabilities define."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.precision import reference_model

MAX_TOKENS = 5
# The engine runs in float32; its logits match float64 transformers to ~2e-5 on the CPUs seen
# (summation order differs between machines). A logprob subtracts one logsumexp of such logits,
# so its error is at most about twice that: 1e-4 leaves a margin and still catches any real bug
# (a temperature or top-p applied before the logprobs moves them by > 1e-2).
ATOL = 1e-4


def _rank_fn(rank, world_size, model_dir, prompts):
    from distributed import init_distributed
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.llm_engine import LLMEngine
    from launch.engine.request import Request, SamplingParams

    args = EngineArgs(
        model=model_dir,
        dtype="float32",
        data_parallel_size=world_size,
        enable_expert_parallel=True,
        enable_dbo=True,
        dbo_decode_token_threshold=2,
        dbo_prefill_token_threshold=4,
        distributed_timeout_s=60,
    )
    groups = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=True, timeout_s=60
    )
    engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
    kinds = [
        SamplingParams(max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),  # no logprobs asked
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=0.6,
            seed=rank,
            logprobs=0,
            ignore_eos=True,
        ),
    ]
    for i, params in enumerate(kinds):
        request_id = rank * len(kinds) + i
        engine.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompts[request_id]),
                sampling_params=params,
            )
        )
    finished = engine.run_until_done()
    return {
        r.request_id: (
            r.output_token_ids,
            [
                (lp.token_id, lp.logprob, lp.top_token_ids, lp.top_logprobs)
                for lp in r.output_logprobs
            ],
        )
        for r in finished
    }


@pytest.mark.slow
def test_logprobs_equal_transformers_float64(tiny_mixtral_dir, tiny_prompts):
    per_rank = run_distributed(_rank_fn, 2, tiny_mixtral_dir, tiny_prompts, timeout_s=240)
    results = {k: v for r in per_rank for k, v in r.items()}
    reference = reference_model(tiny_mixtral_dir)
    for request_id, (tokens, logprobs) in sorted(results.items()):
        kind = request_id % 3
        assert len(tokens) == MAX_TOKENS
        if kind == 1:
            assert logprobs == [], request_id  # not asked: not computed
            continue
        prompt = tiny_prompts[request_id]
        with torch.no_grad():
            ref = reference(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
        for step, (token, logprob, top_ids, top_values) in enumerate(logprobs):
            row = ref[len(prompt) - 1 + step]  # the position that produced output token `step`
            assert token == tokens[step]
            assert logprob == pytest.approx(float(row[token]), abs=ATOL), (request_id, step)
            if kind == 0:  # greedy: the sampled token is the row's max, then the top 3 in order
                expected = torch.topk(row, 3)
                assert top_ids == tuple(expected.indices.tolist())
                assert top_values == pytest.approx(expected.values.tolist(), abs=ATOL)
                assert logprob == top_values[0]
            else:  # top-p 0.6 at temperature 1: the token lies in the nucleus of the 0.6 mass
                probs = row.exp()
                mass_above = float(probs[probs > probs[token]].sum())
                assert mass_above < 0.6 + ATOL and top_ids == ()
