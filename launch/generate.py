"""Offline batched generation over DP ranks: ``torchrun --nproc-per-node N -m launch.generate``.

Built on the offline API (``launch.LLM``): JSONL prompts (text or token ids) are spread over the
DP ranks, every rank generates its share in lockstep, and rank 0 writes the outputs in input order
and prints a summary. Flags and output format: docs/models.md#generating-offline."""

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
from launch.engine.embedded import synthetic_prompts
from launch.engine.output_paths import check_output_paths
from launch.engine.request import SamplingParams, offset_seed
from launch.engine.startup import seconds_since_process_start
from launch.offline.config import OfflineModel, load_offline_model
from launch.offline.prompts import ParsedPrompt, check_prompts, encode_prompts, read_prompts

PROG = "launch.generate"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompts",
        default=None,
        help="JSONL of {'prompt': 'text'} (needs the checkpoint's tokenizer.json) or "
        "{'prompt_token_ids': [...]}",
    )
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
    """Token-id prompts of a JSONL file (``launch.bench_throughput``'s dataset): lines
    ``{"prompt_token_ids": [int, ...]}``. Raises as ``read_prompts`` does (text lines refused)."""
    return [list(p.token_ids) for p in read_prompts(path, allow_text=False)]


def load_checked_prompts(ns, offline_model: OfflineModel) -> list[ParsedPrompt]:
    """``--prompts`` (or the synthetic ones), encoded and checked against the model.

    Raises:
        ValueError: a malformed file line, a text prompt without a tokenizer (naming the missing
            file), a text too long to fit (refused before tokenizing), or a prompt that is empty,
            too long or holds an out-of-vocabulary id.
        OSError: an unreadable file.
    """
    resolved = offline_model.resolved
    if ns.prompts:
        prompts = read_prompts(ns.prompts)
    else:
        ids = synthetic_prompts(seed=resolved.seed, vocab_size=resolved.config.vocab_size)
        prompts = [ParsedPrompt(text=None, token_ids=tuple(p)) for p in ids]
    prompts = encode_prompts(
        prompts,
        offline_model.tokenizer,
        offline_model.tokenizer_dir,
        max_model_len=resolved.max_model_len,
    )
    check_prompts(
        [p.token_ids for p in prompts],
        vocab_size=resolved.config.vocab_size,
        max_model_len=resolved.max_model_len,
    )
    return prompts


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = engine_args_from_namespace(ns)
        args.check_world_size(world_size)
        TorchrunEnv.from_environ()  # a plain `python -m` run: one line, not a traceback later
        SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)  # validates
        check_output_paths(args, {"--output": ns.output})
        offline_model = load_offline_model(args)
        prompts = load_checked_prompts(ns, offline_model)
    except (ValueError, TypeError, OSError) as e:
        fail(PROG, rank, e)

    from distributed import destroy_distributed
    from distributed.liveness import describe_failure
    from launch.offline.llm import LLM

    llm = None
    try:
        llm = LLM.from_engine_args(args, offline_model)
        if llm.dp_rank == 0:
            all2all = llm.llm_engine.observability.all2all_summary()
            print(f"{PROG}: expert all-to-all: {all2all}", flush=True)
        run(llm, ns, args, prompts)
    except Exception as e:  # noqa: BLE001 - every failure ends this rank with one clear line
        fail(PROG, rank, describe_failure(e, None if llm is None else llm.heartbeat), status=1)
    finally:
        if llm is not None:
            llm.shutdown()
        destroy_distributed()
    return 0


def run(llm, ns, args, prompts: list[ParsedPrompt]) -> None:
    """Generate this rank's share of ``prompts``; rank 0 writes and prints the results."""
    from launch.engine.dp_load_balancer import offline_share

    share = offline_share(
        [len(p.token_ids) + ns.max_tokens for p in prompts],
        dp_rank=llm.dp_rank,
        dp_size=llm.dp_size,
        method=args.load_balance_method,
    )
    params = [
        SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            seed=prompt_seed(args.seed, index),
        )
        for index in share
    ]
    startup_s = seconds_since_process_start()  # the first step starts now
    if llm.llm_engine.observability.profiler is not None:  # --profiler-config: the whole run
        llm.start_profile()
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": list(prompts[i].token_ids)} for i in share], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    llm.stop_profile()
    llm.llm_engine.observability.write_timeline()
    mine = [
        output_line(index, prompts[index], out.outputs[0], has_text=llm.get_tokenizer() is not None)
        for index, out in zip(share, outputs, strict=True)
    ]
    gathered = gather_to_rank0(mine, llm.llm_engine.groups)
    if llm.dp_rank == 0:
        report(gathered, llm.llm_engine, elapsed, ns.output, startup_s=startup_s)


def prompt_seed(seed: int, index: int) -> int:
    """``seed + index`` wrapped into the 64-bit signed range SamplingParams takes."""
    return offset_seed(seed, index)


def output_line(index: int, prompt: ParsedPrompt, completion, *, has_text: bool) -> dict:
    """One output JSON line: index, prompt (if text), ids, text (with a tokenizer), error."""
    line: dict = {"index": index}
    if prompt.text is not None:
        line["prompt"] = prompt.text
    line["prompt_token_ids"] = list(prompt.token_ids)
    line["output_token_ids"] = completion.token_ids
    if has_text:
        line["text"] = completion.text
    if completion.error is not None:  # this prompt alone failed (e.g. NaN logits)
        line["error"] = completion.error
    return line


def gather_to_rank0(mine: list[dict], groups) -> list[dict]:
    """Every DP rank's output lines, sorted by index (blocking collective, group timeout)."""
    if groups.dp_size == 1:
        return sorted(mine, key=lambda line: line["index"])
    import torch.distributed as dist

    everyone: list = [None] * groups.dp_size
    dist.all_gather_object(everyone, mine, group=groups.dp_group)
    return sorted((line for part in everyone for line in part), key=lambda line: line["index"])


def report(
    results: list[dict], engine, elapsed: float, output: str | None, *, startup_s: float
) -> None:
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in results)
    observability = engine.observability
    stats = observability.stats
    num_generated = sum(len(line["output_token_ids"]) for line in results)
    num_failed = sum("error" in line for line in results)
    print(
        f"{PROG}: {len(results)} prompts, {num_generated} tokens generated in {elapsed:.2f} s "
        f"({num_generated / max(elapsed, 1e-9):.1f} tokens/s) "
        f"over {engine.groups.dp_size} DP rank(s); "
        f"{stats.num_steps} steps, {stats.num_ubatched_steps} microbatched (DBO); "
        f"all2all {observability.all2all_summary()}; "
        f"start-up {startup_s:.2f} s (process start to first step, rank 0)"
        + (f"; {num_failed} prompt(s) failed (see 'error' in the output)" if num_failed else "")
        + (f"; wrote {output}" if output else ""),
        flush=True,
    )
    if observability.dbo_summary():
        print(f"{PROG}: {observability.dbo_summary()}", flush=True)
    print(f"{PROG}: rank 0 memory: {observability.memory.summary()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
