"""When this process started, for the start-up time the entry points print (process start -> first
step: interpreter, imports, model build and load, KV cache, process groups)."""

from __future__ import annotations

import gc
import os
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
