"""The engine's start-up: when this process started (for the start-up time the entry points print:
process start -> first step: interpreter, imports, model build and load, KV cache, process groups),
the rank's process groups from the flags, the compute dtype and its log lines, the model built
under the process-wide op settings, and the GC heap frozen once it is all built."""

from __future__ import annotations

import gc
import os
import sys
import time

_IMPORT_TIME = time.time()  # fallback: when this module was first imported


def process_start_time() -> float:
    """Wall-clock time (seconds since the epoch) at which this process started.

    Linux: ``/proc/self/stat`` field 22 (start time in clock ticks after boot) plus the boot time
    (``btime`` in ``/proc/stat``), resolution one clock tick (10 ms). Elsewhere, or if /proc cannot
    be read, the time this module was first imported (later than the true start).
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # the command name (field 2) may hold spaces: count fields after its closing ')'
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 overall
        with open("/proc/stat", encoding="ascii") as f:
            boot_time = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot_time + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME


def seconds_since_process_start() -> float:
    return time.time() - process_start_time()


def freeze_gc_heap() -> None:
    """Collect, then freeze every object the garbage collector tracks (vLLM's ``freeze_gc_heap``,
    called where its ``EngineCore`` finishes start-up): the model, caches and imports built at
    start-up are never scanned again, so the full collections that serving's allocations trigger
    stay short. Without it a full collection over the start-up heap landed in a short timed run
    of ``launch.bench_throughput`` on the tiny checkpoint and cost a visible share of its
    throughput (docs/benchmarks.md, "Offline throughput"). Objects frozen here are still freed by
    reference counting; only cyclic garbage among them is kept (an engine is built once per
    process)."""
    gc.collect()  # a full collection (generation 2 includes the younger ones)
    gc.freeze()


def log_startup(rank: int, line: str) -> None:
    """One start-up line on stderr, from rank 0 only."""
    if rank == 0:
        print(f"moe-dbo: {line}", file=sys.stderr, flush=True)


def select_compute_dtype(args, platform, groups):
    """The torch dtype the model runs in (``platform``'s answer for ``args.dtype``; ``args``:
    ``EngineArgs``, ``groups``: ``distributed.ParallelGroups``); logs the platform, the device,
    the attention backend, the collectives, the platform's config notes and why the dtype differs
    from the request, if it does."""
    chosen = args.compute_dtype()
    for line in (
        platform.describe(),
        f"device {platform.describe_device(groups.device)}",
        f"attention backend {args.attention_backend}",
    ):
        log_startup(groups.rank, line)
    if groups.dp_comm is not None:
        log_startup(groups.rank, f"collectives over {groups.dp_comm.backend}")
    for note in args.platform_notes:
        log_startup(groups.rank, note)
    if chosen.reason is not None:
        as_name = str(chosen.dtype).removeprefix("torch.")
        log_startup(groups.rank, f"--dtype {args.dtype} runs as {as_name}: {chosen.reason}")
    return chosen.dtype


def build_rank_model(args, config, *, dtype, groups, prepare_finalize):
    """The model of ``config`` (``MoEModelConfig``) in ``dtype`` with this rank's experts
    (``groups``), over ``prepare_finalize`` (None without expert parallelism); weights not loaded
    yet. First sets the process-wide op choices of ``args`` (``EngineArgs``): general plugins,
    ``--custom-ops``, ``--attention-backend``. Raises ValueError as ``moe.build_model``."""
    # imported here: the entry points import this module for the start time, before any model
    from moe.layers.attention_backend import AttentionBackendEnum
    from moe.layers.attention_selector import set_attention_backend
    from moe.models.registry import build_model
    from moe.platforms.custom_op import set_custom_ops
    from moe.platforms.plugins import load_general_plugins

    # plugins may register out-of-tree ops; both must precede the build (ops bind at build)
    load_general_plugins()
    set_custom_ops(args.custom_ops)
    set_attention_backend(AttentionBackendEnum(args.attention_backend))
    return build_model(
        config,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        prepare_finalize=prepare_finalize,
        dtype=dtype,
        device=groups.device,
    )


def init_engine_groups(args):
    """This rank's ``distributed.ParallelGroups`` for ``args`` (``EngineArgs``: DP size, expert
    parallelism, ``--distributed-timeout-s``, ``--share-gpus``) on the current platform, from the
    torchrun environment. Collective: every rank calls it. Raises as
    ``distributed.init_parallel_groups``."""
    from distributed import init_parallel_groups
    from moe.platforms.plugins import current_platform

    return init_parallel_groups(
        current_platform(),
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        timeout_s=args.distributed_timeout_s,
        share_devices=args.share_gpus,
    )
