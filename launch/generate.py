"""Offline batched generation over DP ranks: ``torchrun --nproc-per-node N -m launch.generate``.

Prompts (JSONL lines ``{"prompt_token_ids": [...]}``; synthetic ones with the embedded default)
are spread over the DP ranks by ``--load-balance-method`` (round robin by default); all ranks step in lockstep until every prompt is done;
rank 0 writes ``{"index", "prompt_token_ids", "output_token_ids"}`` lines in input order and prints
a summary. Every input error is reported as one line on every rank before any process group exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from distributed.parallel_state import TorchrunEnv
from launch.engine.arg_utils import (
    OneLineErrorParser,
    add_engine_args,
    engine_args_from_namespace,
    fail,
)
from launch.engine.llm_engine import LLMEngine, init_parallel_groups, resolve_model
from launch.engine.output_paths import check_output_paths
from launch.engine.request import MAX_SEED, MIN_SEED, Request, SamplingParams
from launch.engine.startup import seconds_since_process_start

PROG = "launch.generate"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=None, help="JSONL of {'prompt_token_ids': [...]}")
    parser.add_argument("--output", default=None, help="JSONL file rank 0 writes the results to")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="finite, >= 0; below 1e-5 = greedy (vLLM's rule)",
    )
    add_engine_args(parser)
    return parser


def load_prompts(path: str) -> list[list[int]]:
    """Read ``{"prompt_token_ids": [int, ...]}`` JSONL lines (blank lines skipped).

    Raises:
        ValueError: naming the file and line of a malformed entry, or an empty file.
        OSError: if the file cannot be read.
    """
    prompts: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["prompt_token_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object with 'prompt_token_ids' ({e})"
                ) from None
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError(f"{path}:{lineno}: 'prompt_token_ids' must be a list of ints")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def check_prompts(prompts: list[list[int]], *, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming the first prompt that is empty, too long or has an out-of-vocab id."""
    for index, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) >= max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with --max-model-len {max_model_len} "
                f"prompts must have at most {max_model_len - 1} tokens"
            )
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {index} has token id {bad} outside [0, {vocab_size})")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = engine_args_from_namespace(ns)
        args.check_world_size(world_size)
        TorchrunEnv.from_environ()  # a plain `python -m` run: one line, not a traceback later
        SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)  # validates
        check_output_paths(output=ns.output, timeline_dir=args.timeline_dir)
        model = resolve_model(args)
        prompts = load_prompts(ns.prompts) if ns.prompts else model.synthetic_prompts()
        check_prompts(
            prompts, vocab_size=model.config.vocab_size, max_model_len=model.max_model_len
        )
    except (ValueError, OSError) as e:
        fail(PROG, rank, e)

    from distributed import destroy_distributed
    from distributed.liveness import Heartbeat, describe_failure
    from launch.engine.dp_load_balancer import offline_share

    groups = init_parallel_groups(args)
    heartbeat = Heartbeat(rank=groups.rank, world_size=groups.world_size).start()
    try:
        engine = LLMEngine(engine_args=args, model=model, groups=groups)
        if groups.rank == 0:
            print(f"{PROG}: expert all-to-all: {engine.all2all_summary()}", flush=True)
        share = offline_share(
            [len(p) + ns.max_tokens for p in prompts],
            dp_rank=groups.dp_rank,
            dp_size=groups.dp_size,
            method=args.load_balance_method,
        )
        for index in share:
            engine.add_request(
                Request(
                    request_id=index,
                    prompt_token_ids=list(prompts[index]),
                    sampling_params=SamplingParams(
                        max_tokens=ns.max_tokens,
                        temperature=ns.temperature,
                        seed=prompt_seed(args.seed, index),
                    ),
                )
            )
        startup_s = seconds_since_process_start()  # the first step starts now
        start = time.perf_counter()
        finished = engine.run_until_done()
        elapsed = time.perf_counter() - start
        engine.write_timeline()
        gathered = gather_to_rank0(finished, groups)
        if groups.rank == 0:
            report(gathered, engine, elapsed, ns.output, startup_s=startup_s)
    except Exception as e:  # noqa: BLE001 - every failure ends this rank with one clear line
        fail(PROG, rank, describe_failure(e, heartbeat), status=1)
    finally:
        heartbeat.stop()
        destroy_distributed()
    return 0


def prompt_seed(seed: int, index: int) -> int:
    """``seed + index`` wrapped into the 64-bit signed range SamplingParams takes."""
    return (seed + index - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED


def gather_to_rank0(finished: list[Request], groups) -> list[Request]:
    """All finished requests of every DP rank, sorted by index (blocking collective, group timeout)."""
    import torch.distributed as dist

    mine = [(r.request_id, r.prompt_token_ids, r.output_token_ids, r.error) for r in finished]
    everyone: list = [None] * groups.dp_size
    dist.all_gather_object(everyone, mine, group=groups.dp_group)
    return sorted((item for part in everyone for item in part), key=lambda item: item[0])


def report(
    results, engine: LLMEngine, elapsed: float, output: str | None, *, startup_s: float
) -> None:
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            for index, prompt, out, error in results:
                line = {"index": index, "prompt_token_ids": prompt, "output_token_ids": out}
                if error is not None:  # this prompt alone failed (e.g. NaN logits)
                    line["error"] = error
                f.write(json.dumps(line) + "\n")
    stats = engine.stats
    num_generated = sum(len(out) for _, _, out, _ in results)
    num_failed = sum(error is not None for *_, error in results)
    print(
        f"{PROG}: {len(results)} prompts, {num_generated} tokens generated in {elapsed:.2f} s "
        f"({num_generated / max(elapsed, 1e-9):.1f} tokens/s) over {engine.groups.dp_size} DP rank(s); "
        f"{stats.num_steps} steps, {stats.num_ubatched_steps} microbatched (DBO); "
        f"all2all {engine.all2all_summary()}; "
        f"start-up {startup_s:.2f} s (process start to first step, rank 0)"
        + (f"; {num_failed} prompt(s) failed (see 'error' in the output)" if num_failed else "")
        + (f"; wrote {output}" if output else ""),
        flush=True,
    )
    if engine.dbo_summary():
        print(f"{PROG}: {engine.dbo_summary()}", flush=True)
    print(f"{PROG}: rank 0 memory: {engine.memory.summary()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
