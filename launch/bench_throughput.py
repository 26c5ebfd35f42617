"""Offline throughput benchmark with ``vllm bench throughput``'s flags and summary line.

``torchrun --nproc-per-node N -m launch.bench_throughput``: every rank builds the same requests
(``launch.benchmarks.throughput``) and serves its share through ``LLMEngine`` as
``launch.generate`` does, after an untimed warm-up; rank 0 prints vLLM's line and ours and writes
``--output-json``. Flags, output, ``--roofline``:
docs/benchmarks.md#offline-throughput-launchbench_throughput."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from distributed.parallel_state import TorchrunEnv
from launch.benchmarks.throughput import (
    DATASET_NAMES,
    ThroughputResult,
    process_age_s,
    sample_requests,
)
from launch.engine.arg_utils import (
    OneLineErrorParser,
    add_engine_args,
    engine_args_from_namespace,
    fail,
)
from launch.engine.output_paths import check_output_paths
from launch.generate import check_prompts, load_prompts

PROG = "launch.bench_throughput"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--dataset-name", default="random", choices=DATASET_NAMES)
    add("--dataset-path", default=None, help="JSONL of {'prompt_token_ids': [...]} (jsonl)")
    add("--input-len", type=int, default=128, help="prompt tokens per request (random)")
    add("--output-len", type=int, default=32, help="tokens generated per request")
    add("--num-prompts", type=int, default=80, help="number of requests")
    add(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="length spread r: [len(1-r), len(1+r)]",
    )
    add(
        "--warmup-output-len",
        type=int,
        default=2,
        help="untimed warm-up: tokens per prompt (0: none)",
    )
    add("--output-json", default=None, help="write the results as JSON (rank 0)")
    add("--output-tokens", default=None, help="write the generated tokens as JSONL (rank 0)")
    add(
        "--profile",
        action="store_true",
        help="profile the timed run on every rank (needs --profiler-config; the warm-up is not "
        "recorded)",
    )
    add(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print per step kind the memory-roofline fraction (bytes a step must read over the "
        "measured copy bandwidth, against the step time) and the matmul-peak fraction (default: "
        "on where the device is not the host CPU; one rank)",
    )
    add_engine_args(parser)
    return parser


def run_requests(engine, requests, *, first_id: int, max_tokens: int | None, dp) -> list:
    """Add this DP rank's share of ``requests`` (``--load-balance-method``) and step until every
    rank is done."""
    from launch.engine.dp_load_balancer import offline_share
    from launch.engine.request import Request, SamplingParams

    rank, size = dp
    lengths = [len(r.prompt_token_ids) + (max_tokens or r.output_len) for r in requests]
    method = engine.args.load_balance_method
    for index in offline_share(lengths, dp_rank=rank, dp_size=size, method=method):
        engine.add_request(
            Request(
                request_id=first_id + index,
                prompt_token_ids=list(requests[index].prompt_token_ids),
                sampling_params=SamplingParams(
                    max_tokens=max_tokens or requests[index].output_len, ignore_eos=True
                ),
            )
        )
    return engine.run_until_done()


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = engine_args_from_namespace(ns)
        args.check_world_size(world_size)
        if ns.warmup_output_len < 0:
            raise ValueError(f"--warmup-output-len must be >= 0, got {ns.warmup_output_len}")
        if ns.profile and not args.profiler().is_on:
            raise ValueError(
                "--profile needs --profiler-config, e.g. "
                '\'{"profiler": "torch", "torch_profiler_dir": DIR}\''
            )
        check_output_paths(
            args, {"--output-json": ns.output_json, "--output-tokens": ns.output_tokens}
        )
        TorchrunEnv.from_environ()  # a plain `python -m` run: one line, not a traceback later
        model = args.resolve_model()
        requests = sample_requests(
            dataset_name=ns.dataset_name,
            dataset_path=ns.dataset_path,
            num_prompts=ns.num_prompts,
            input_len=ns.input_len,
            output_len=ns.output_len,
            range_ratio=ns.random_range_ratio,
            seed=ns.seed,
            vocab_size=model.config.vocab_size,
            load_prompts=load_prompts,
        )
        check_prompts(
            [r.prompt_token_ids for r in requests],
            vocab_size=model.config.vocab_size,
            max_model_len=model.max_model_len,
        )
    except (ValueError, OSError) as e:
        fail(PROG, rank, e)

    from distributed import destroy_distributed
    from launch.engine.startup import init_engine_groups

    groups = init_engine_groups(args)
    try:
        result, tokens = benchmark(ns, args, model, requests, groups)
        if groups.rank == 0:
            report(result, tokens, ns)
    except Exception as e:  # noqa: BLE001 - every failure ends this rank with one clear line
        fail(PROG, rank, f"{type(e).__name__}: {e}", status=1)
    finally:
        destroy_distributed()
    return 0


def benchmark(ns, args, model, requests, groups):
    """Build the engine, warm up, run the timed requests; (ThroughputResult, sorted tokens)."""
    import torch.distributed as dist

    from launch.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_args=args, model=model, groups=groups)
    startup_s = process_age_s()
    dp = (groups.dp_rank, groups.dp_size)
    if ns.warmup_output_len:
        run_requests(
            engine, requests, first_id=len(requests), max_tokens=ns.warmup_output_len, dp=dp
        )
    roofline = _roofline(ns, engine, groups)
    observability, stats = engine.observability, engine.observability.stats
    num_steps0, num_ubatched0 = stats.num_steps, stats.num_ubatched_steps
    dist.barrier(group=groups.dp_group)  # blocking (group timeout): start the clock together
    if ns.profile:
        observability.start_profile()
    start = time.perf_counter()
    finished = run_requests(engine, requests, first_id=0, max_tokens=None, dp=dp)
    elapsed = time.perf_counter() - start
    observability.stop_profile()
    mine = {
        "elapsed": elapsed,
        "tokens": [(r.request_id, r.prompt_token_ids, r.output_token_ids) for r in finished],
    }
    everyone: list = [None] * groups.dp_size
    dist.all_gather_object(everyone, mine, group=groups.dp_group)  # blocking (group timeout)
    tokens = sorted((t for part in everyone for t in part["tokens"]), key=lambda t: t[0])
    elapsed = max(part["elapsed"] for part in everyone)
    num_output = sum(len(out) for _, _, out in tokens)
    num_total = num_output + sum(len(prompt) for _, prompt, _ in tokens)
    capture = engine.graph_stats
    result = ThroughputResult(
        model_id=args.model or "embedded",
        elapsed_time=elapsed,
        num_requests=len(tokens),
        total_num_tokens=num_total,
        total_output_tokens=num_output,
        requests_per_second=len(tokens) / elapsed,
        tokens_per_second=num_total / elapsed,
        output_tokens_per_second=num_output / elapsed,
        num_steps=stats.num_steps - num_steps0,
        num_ubatched_steps=stats.num_ubatched_steps - num_ubatched0,
        startup_s=startup_s,
        graph_capture_s=0.0 if capture is None else capture.seconds,
        graph_mode=capture is not None,
        capture_sizes=[] if capture is None else list(capture.capture_sizes),
        dtype=args.dtype,
        data_parallel_size=groups.dp_size,
        enable_dbo=args.enable_dbo,
        cudagraph_mode=args.cudagraph_mode,
        num_whole_graphs=0 if capture is None else capture.num_whole_graphs,
    )
    observability.write_timeline()
    if roofline is not None:
        print("\n".join(roofline.lines()), flush=True)
    return result, tokens


def _roofline(ns, engine, groups):
    """A ``StepRoofline`` attached to ``engine``'s timed steps, or None (``--roofline``; by
    default on where the device is not the host; one rank only: a rank's share of the all-to-all
    is not in its byte count)."""
    from moe.platforms import current_platform
    from moe.platforms.device_probes import is_host

    wanted = ns.roofline if ns.roofline is not None else not is_host(groups.device)
    if not wanted or groups.dp_size > 1:
        return None
    from launch.benchmarks.roofline import ModelTraffic, StepRoofline, copy_bandwidth, matmul_peak

    device = groups.device
    dtype = engine.model.lm_head.weight.dtype

    def synchronize() -> None:
        current_platform().synchronize(device)

    small = is_host(device)  # a CPU measures its limits on smaller buffers in seconds
    roofline = StepRoofline(
        traffic=ModelTraffic.of(engine.model, dtype),
        bandwidth=copy_bandwidth(device, synchronize, mib=64 if small else 1024),
        peak=matmul_peak(device, dtype, synchronize, n=1024 if small else 8192),
    )
    roofline.attach(engine, synchronize)
    return roofline


def report(result: ThroughputResult, tokens, ns) -> None:
    print(result.summary_line(), flush=True)
    print(f"Total num prompt tokens:  {result.total_num_tokens - result.total_output_tokens}")
    print(f"Total num output tokens:  {result.total_output_tokens}")
    print(f"{PROG}: {result.detail_line()}", flush=True)
    if ns.output_json:
        result.write_json(ns.output_json)
    if ns.output_tokens:
        with open(ns.output_tokens, "w", encoding="utf-8") as f:
            for index, prompt, out in tokens:
                row = {"index": index, "prompt_token_ids": prompt, "output_token_ids": out}
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
