"""DBO benchmark on the engine's own path: ``torchrun --nproc-per-node N -m launch.bench``.

Per batch shape (``--batches decode:16,prefill:1024``) it runs the arms DBO off, on and adaptive
(``--arms``, ``--ubatch-size``) interleaved through ``LLMEngine.step``, on loopback, an emulated
link or under ``launch.netns``, and prints and writes per-shape records of step times and overlap
metrics. Arms, records and links: docs/benchmarks.md#dbo-benchmark-launchbench."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

from distributed.parallel_state import TorchrunEnv
from launch.benchmarks.bench_records import format_table, make_record, write_records
from launch.benchmarks.workload import BatchSpec, Workload, parse_batches
from launch.engine.arg_utils import (
    DEFAULT_UBATCH_SIZE,
    OneLineErrorParser,
    add_engine_args,
    engine_args_from_namespace,
    fail,
)
from launch.engine.output_paths import check_output_paths

PROG = "launch.bench"
NETWORKS = ("loopback", "netns")
ARMS = ("off", "on", "adaptive")
MAX_EXPLORATION_STEPS = 24  # consecutive adaptive steps allowed to decide a bucket


def parse_arms(text: str) -> tuple[str, ...]:
    """``"off,on,adaptive"`` -> arms in that order; off and on are required (the baselines).

    Raises:
        ValueError: an unknown or repeated arm, or off / on missing.
    """
    arms = tuple(a.strip() for a in text.split(","))
    if (
        any(a not in ARMS for a in arms)
        or len(set(arms)) != len(arms)
        or not {"off", "on"} <= set(arms)
    ):
        raise ValueError(f"--arms {text!r}: need off and on, optionally adaptive, each once")
    return arms


def expand_arms(arms: tuple[str, ...], ubatch_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The interleaved arms: ``on`` becomes ``on:N`` for each ubatch count N (``off,on`` with
    counts 2 and 3 -> ``off, on:2, on:3``)."""
    expanded: list[str] = []
    for arm in arms:
        expanded += [f"on:{n}" for n in ubatch_sizes] if arm == "on" else [arm]
    return tuple(expanded)


def split_arm(label: str) -> tuple[str, int | None]:
    """``"on:3"`` -> ``("on", 3)``; ``"off"`` -> ``("off", None)``."""
    arm, _, count = label.partition(":")
    return arm, int(count) if count else None


def build_parser() -> argparse.ArgumentParser:
    # "resolve": --ubatch-size takes a list here, replacing the engine flag of one count
    parser = OneLineErrorParser(
        prog=PROG, description=__doc__.splitlines()[0], conflict_handler="resolve"
    )
    add = parser.add_argument
    add(
        "--batches",
        default="decode:16,decode:64,prefill:256,prefill:1024",
        help="batch shapes: decode:T / prefill:T, T = tokens per rank per step",
    )
    add("--warmup", type=int, default=2, help="unmeasured steps per mode and shape")
    add("--reps", type=int, default=5, help="measured steps per mode and shape")
    add("--arms", default=",".join(ARMS), help="interleaved arms: off,on[,adaptive]")
    add("--output", default=None, help="JSON file for the records (rank 0)")
    add("--network", default="loopback", choices=NETWORKS, help="label of the link in use")
    add("--hidden-size", type=int, default=None, help="override the embedded model's hidden size")
    add("--intermediate-size", type=int, default=None, help="override the expert MLP width")
    add("--num-experts", type=int, default=None, help="override the number of experts")
    add("--num-layers", type=int, default=None, help="override the number of decoder layers")
    add("--num-threads", type=int, default=None, help="torch intra-op threads per rank")
    add_engine_args(parser)
    add(
        "--ubatch-size",
        "--num-ubatches",
        dest="ubatch_sizes",
        type=int,
        nargs="+",
        default=[DEFAULT_UBATCH_SIZE],
        metavar="N",
        help="ubatch counts of the on arm to compare, e.g. 2 3 4 (one on arm each, interleaved)",
    )
    return parser


def model_overrides(ns) -> dict:
    """HF config keys to override in the embedded model (only where a flag was given)."""
    pairs = {
        "hidden_size": ns.hidden_size,
        "intermediate_size": ns.intermediate_size,
        "num_local_experts": ns.num_experts,
        "num_hidden_layers": ns.num_layers,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def resolve_bench_model(args, overrides: dict):
    """The embedded model with ``overrides`` (random weights), or ``--model`` (no overrides).

    Raises:
        ValueError: overrides together with ``--model``, or an invalid resulting config.
    """
    from moe import MoEModelConfig
    from moe.model_loader import EMBEDDED_MODEL_CONFIG, ResolvedModel

    if args.model is not None:
        if overrides:
            raise ValueError(f"--model cannot be combined with shape overrides {overrides}")
        return args.resolve_model()
    hf = {**EMBEDDED_MODEL_CONFIG, **overrides}
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.max_model_len or 0)
    return ResolvedModel(
        config=MoEModelConfig.from_hf_config(hf),
        checkpoint_dir=None,
        max_model_len=args.max_model_len or hf["max_position_embeddings"],
        seed=args.seed,
        load_format=args.load_format,
    )


def span_cost_ns(num_spans: int = 20_000) -> float:
    """Nanoseconds one ``timeline_span`` costs with a recorder installed, minus the bare loop."""
    from dbo import TimelineRecorder, get_timeline_recorder, set_timeline_recorder, timeline_span

    previous = get_timeline_recorder()
    set_timeline_recorder(TimelineRecorder(rank=0))
    try:
        start = time.perf_counter_ns()
        for _ in range(num_spans):
            with timeline_span("x"):
                pass
        recorded = time.perf_counter_ns() - start
    finally:
        set_timeline_recorder(previous)
    start = time.perf_counter_ns()
    for _ in range(num_spans):
        pass
    return max(recorded - (time.perf_counter_ns() - start), 0) / num_spans


def balanced_order(arms: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The arms' order in round ``rep``: a Williams design (every rotation, forwards and
    backwards: off on ad, on ad off, ad off on, ad on off, ...), so slow drift (growing KV) and
    any after-effect of the previous step (e.g. of a DBO step on the next) weigh on every arm
    alike."""
    n = len(arms)
    rotated = arms[rep % n :] + arms[: rep % n]
    return rotated if (rep // n) % 2 == 0 else rotated[::-1]


def set_arm(engine, label: str, args) -> None:
    """Switch the engine's model runner to the arm ``label`` (``off``, ``on:N``, ``adaptive``; see
    the module docstring); off and adaptive keep the engine args' ubatch count."""
    arm, num_ubatches = split_arm(label)

    def static(threshold):
        return 2 if threshold == "auto" else threshold

    if arm == "adaptive":
        thresholds = ("auto", "auto")
    else:
        thresholds = (
            static(args.dbo_decode_token_threshold),
            static(args.dbo_prefill_token_threshold),
        )
    engine.model_runner.set_dbo(
        enable_dbo=arm != "off",
        dbo_decode_token_threshold=thresholds[0],
        dbo_prefill_token_threshold=thresholds[1],
        ubatch_size=num_ubatches or args.num_ubatches,
    )


def measure_step(engine, workload: Workload, label: str, args) -> dict:
    """Run one engine step of the arm ``label``; return this rank's metrics of it (a dict): the
    step's metrics, ``arm`` (off / on / adaptive), ``ubatch_size`` (the count the arm asked for),
    ``num_ubatches`` (the count the step ran; 1 without microbatching), ``exploring``."""
    from dbo.timeline.metrics import spans_from_recorder, step_metrics

    arm, num_ubatches = split_arm(label)
    set_arm(engine, label, args)
    workload.before_step()
    timeline = engine.observability.timeline
    first = len(timeline)
    engine.step()
    spans = spans_from_recorder(timeline, first)
    (metrics,) = step_metrics(spans)
    (step_span,) = (s for s in spans if s.cat == "step")
    return {
        **metrics.as_dict(),
        "arm": arm,
        "dbo": arm != "off",
        "ubatch_size": num_ubatches or args.num_ubatches,
        "num_ubatches": int(step_span.args.get("num_ubatches", 1)),
        "exploring": step_span.args.get("dbo_policy") == "explore",
        "num_spans": len(spans),
    }


def num_workload_steps(arms: tuple[str, ...], ns) -> int:
    """Steps a batch shape's workload provides: warm-up and measured steps of every arm, and
    the adaptive arm's exploration if it runs (decode requests generate exactly that many tokens,
    so none is left to drain after the measured steps)."""
    exploration = MAX_EXPLORATION_STEPS if "adaptive" in arms else 0
    return len(arms) * (ns.warmup + ns.reps) + exploration


def run_batch(engine, spec: BatchSpec, ns, args, vocab_size: int, progress) -> list[dict]:
    """Warm-up, the adaptive arm's exploration, interleaved measured steps of one batch shape;
    this rank's step dicts of the exploration and measured steps (the same sequence on every
    rank: the policy's state is identical on every rank)."""
    arms = expand_arms(parse_arms(ns.arms), tuple(ns.ubatch_sizes))
    num_steps = num_workload_steps(arms, ns)
    workload = Workload(engine, spec, num_steps=num_steps, vocab_size=vocab_size, seed=ns.seed)
    workload.prepare()
    kept = []
    for _ in range(ns.warmup):
        for arm in arms:
            step = measure_step(engine, workload, arm, args)
            if step["exploring"]:  # the policy's cost, reported with the exploration steps
                kept.append(step)
            progress.update(1)
    if "adaptive" in arms:
        for _ in range(MAX_EXPLORATION_STEPS):
            step = measure_step(engine, workload, "adaptive", args)
            if not step["exploring"]:
                break
            kept.append(step)
    for i in range(ns.reps):
        for arm in balanced_order(arms, i):
            kept.append({**measure_step(engine, workload, arm, args), "round": i})
            progress.update(1)
    workload.drain()
    return kept


def resolve_run(ns, rank: int, world_size: int):
    """Check the command line before any work starts; the engine args and the model to build.
    Exits with one line naming the bad value (``fail``)."""
    try:
        checked = check_run(ns, world_size)
        TorchrunEnv.from_environ()  # a plain `python -m` run: one line, not a traceback later
        return checked
    except (ValueError, OSError) as e:
        fail(PROG, rank, e)


def check_run(ns, world_size: int):
    """The command line's checks (``resolve_run``'s, without the torchrun environment; also what
    ``launch.plan_sweep`` runs on the flags it passes on): (batch specs, arms, engine args, model).
    Adjusts ``ns`` (the engine limits the batches need).

    Raises:
        ValueError: naming the bad flag and value. OSError: an unreadable ``--model``.
    """
    if ns.num_threads is not None and ns.num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {ns.num_threads}")
    specs = parse_batches(ns.batches)
    if len(set(ns.ubatch_sizes)) != len(ns.ubatch_sizes):
        raise ValueError(f"--ubatch-size {ns.ubatch_sizes}: each count once")
    arms = expand_arms(parse_arms(ns.arms), tuple(ns.ubatch_sizes))
    if ns.warmup < 0 or ns.reps < 1:
        raise ValueError(f"need --warmup >= 0 and --reps >= 1, got {ns.warmup}, {ns.reps}")
    limits = Workload.limits(specs, num_workload_steps(arms, ns))
    ns.enable_dbo = True  # the benchmark switches DBO per step
    ns.ubatch_size = ns.ubatch_sizes[0]  # the engine's count; the on arms set theirs
    ns.max_num_seqs = max(ns.max_num_seqs, limits["max_num_seqs"])
    ns.max_num_batched_tokens = max(ns.max_num_batched_tokens, limits["max_num_batched_tokens"])
    ns.max_model_len = ns.max_model_len or limits["max_model_len"]
    args = engine_args_from_namespace(ns)
    for n in ns.ubatch_sizes[1:]:
        dataclasses.replace(args, ubatch_size=n)  # ValueError for a count out of range
    args.check_world_size(world_size)
    check_output_paths(args, {"--output": ns.output})
    return specs, arms, args, resolve_bench_model(args, model_overrides(ns))


def run_all_batches(engine, specs, arms, ns, args, model, rank: int) -> list[list[dict]]:
    """Every batch shape in turn, with a progress bar on rank 0; per shape, this rank's steps."""
    from tqdm import tqdm

    total = len(specs) * len(arms) * (ns.warmup + ns.reps)  # arms: expanded (expand_arms)
    per_spec = []
    with tqdm(total=total, desc=PROG, disable=rank != 0, file=sys.stderr) as progress:
        for spec in specs:
            progress.set_postfix_str(spec.label)
            per_spec.append(run_batch(engine, spec, ns, args, model.config.vocab_size, progress))
    return per_spec


def steps_of_count(steps: list[dict], num_ubatches: int, first: int) -> list[dict]:
    """The steps a record of ``num_ubatches`` compares: every off step, the on steps that asked
    for that count, and the adaptive steps if it is the ``first`` count (the one they ran with)."""
    return [
        s
        for s in steps
        if s["arm"] == "off"
        or (s["arm"] == "on" and s["ubatch_size"] == num_ubatches)
        or (s["arm"] == "adaptive" and num_ubatches == first)
    ]


def report(everyone: list, specs, ns, args, model, all2all: str) -> None:
    """Rank 0: one record per batch shape and ubatch count from every rank's steps; the table and
    the JSON file."""
    first = ns.ubatch_sizes[0]
    records = [
        make_record(
            spec,
            [steps_of_count(steps[i], n, first) for steps, _ in everyone],
            span_cost_ns=statistics.median(c for _, c in everyone),
            meta={**run_meta(ns, args, model), "all2all": all2all, "ubatch_size": n},
        )
        for i, spec in enumerate(specs)
        for n in ns.ubatch_sizes
    ]
    print(format_table(records), flush=True)
    if ns.output:
        write_records(records, ns.output)
        print(f"{PROG}: wrote {ns.output}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    specs, arms, args, model = resolve_run(ns, rank, int(os.environ.get("WORLD_SIZE", "1")))

    import torch
    import torch.distributed as dist

    from distributed import destroy_distributed
    from distributed.all2all.ep_backend import check_num_ubatches
    from launch.engine.llm_engine import LLMEngine
    from launch.engine.startup import init_engine_groups

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    groups = init_engine_groups(args)
    try:
        cost_ns = span_cost_ns()
        engine = LLMEngine(engine_args=args, model=model, groups=groups)
        for n in ns.ubatch_sizes:
            check_num_ubatches(engine.prepare_finalize, n)
        engine.scheduler.eos_token_ids = frozenset()  # random weights: never stop a batch early
        observability = engine.observability
        if groups.rank == 0:
            print(f"{PROG}: expert all-to-all: {observability.all2all_summary()}", flush=True)
        observability.start_timeline()
        if observability.profiler is not None:  # --profiler-config: every batch and arm
            observability.start_profile()
        per_spec = run_all_batches(engine, specs, arms, ns, args, model, groups.rank)
        observability.stop_profile()
        observability.write_timeline()
        everyone: list = [None] * groups.world_size
        dist.all_gather_object(everyone, (per_spec, cost_ns))  # blocking collective (timeout)
        if groups.rank == 0:
            report(everyone, specs, ns, args, model, observability.all2all_summary())
        if args.timeline_dir:
            dist.barrier(group=groups.dp_group)  # every rank's file is written before merging
            if groups.rank == 0:
                from launch.timeline import main as timeline_main

                timeline_main([args.timeline_dir])
    except Exception as e:  # noqa: BLE001 - every failure ends this rank with one clear line
        fail(PROG, rank, f"{type(e).__name__}: {e}", status=1)
    finally:
        destroy_distributed()
    return 0


def run_meta(ns, args, model) -> dict:
    """What was measured, stored in every record."""
    config = model.config
    return {
        "network": ns.network,
        "emulate_link": args.emulate_link,
        "all2all_backend": args.all2all_backend,
        "dtype": args.dtype,
        "dp_size": args.data_parallel_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_experts": config.num_experts,
        "num_layers": config.num_hidden_layers,
        "reps": ns.reps,
        "warmup": ns.warmup,
    }


if __name__ == "__main__":
    sys.exit(main())
