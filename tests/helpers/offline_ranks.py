"""``torchrun -m tests.helpers.offline_ranks MODEL_DIR OUT_DIR``: the offline API on every DP rank
(2 ranks, EP, DBO with thresholds low enough for the tiny batches), as vLLM's
``torchrun_dp_example.py`` uses it; each rank writes what it got to ``OUT_DIR/rank{r}.json``.

Prompts are ``TEXT_PROMPTS`` (ids 3..127 as ``<i>`` words); each rank passes its own share
(``prompts[dp_rank::dp_size]``). One run serves several checks (tests/launch/test_offline_api.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from launch import LLM, SamplingParams

CHAT = [{"role": "system", "content": "<9> <8>"}, {"role": "user", "content": "<7> <11> <13>"}]


def text_of(ids: list[int]) -> str:
    return " ".join(f"<{t}>" for t in ids)


def record(outputs) -> list[dict]:
    return [
        {
            "prompt": o.prompt,
            "prompt_token_ids": o.prompt_token_ids,
            "outputs": [dataclasses.asdict(c) for c in o.outputs],
        }
        for o in outputs
    ]


def refused(llm: LLM, prompts) -> dict:
    """A call with bad input: the error every rank raises, and whether any step ran."""
    num_steps = llm.llm_engine.observability.stats.num_steps
    try:
        llm.generate(prompts, use_tqdm=False)
    except (TypeError, ValueError) as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "num_steps": llm.llm_engine.observability.stats.num_steps - num_steps,
        }
    return {"type": None}


def main(model_dir: str, out_dir: str, prompts: list[list[int]]) -> None:
    llm = LLM(
        model_dir,
        dtype="float64",
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_dbo=True,
        dbo_decode_token_threshold=2,
        dbo_prefill_token_threshold=4,
        distributed_executor_backend="external_launcher",
        distributed_timeout_s=60,
    )
    rank, size = llm.dp_rank, llm.dp_size
    mine = prompts[rank::size]
    greedy = SamplingParams(max_tokens=8)
    result = {
        "text": record(llm.generate([text_of(p) for p in mine], greedy)),
        "ids": record(llm.generate([{"prompt_token_ids": p} for p in mine], greedy)),
        # a mix of prompt kinds, one SamplingParams each (max_tokens 1, 2, 3, ...)
        "per_prompt": record(
            llm.generate(
                [text_of(p) if i % 2 else {"prompt_token_ids": p} for i, p in enumerate(mine)],
                [SamplingParams(max_tokens=i + 1) for i in range(len(mine))],
            )
        ),
        "chat": record(llm.chat(CHAT, greedy, use_tqdm=False)),
        # rank 1 alone passes a bad prompt: both ranks must raise, before any step
        "bad_prompt": refused(llm, [text_of(mine[0])] if rank == 0 else [3.5]),
        # rank 1 has nothing to do: it runs dummy batches while rank 0 generates
        "one_rank_idle": record(llm.generate([text_of(prompts[0])] if rank == 0 else [], greedy)),
        "num_ubatched_steps": llm.llm_engine.observability.stats.num_ubatched_steps,
    }
    with open(f"{out_dir}/rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)
    llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
