"""Graph mode vs eager on one decode-shaped forward: ``python -m launch.benchmarks.graph_mode``.

Prints the capture (graphs compiled, seconds) and, per ``--num-tokens`` n, the eager time over the
graph-mode time of the whole model forward (> 1: graph mode is faster), the two interleaved. How
it runs: docs/benchmarks.md#micro-benchmarks."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def _metadata(num_tokens: int, context_len: int, block_size: int):
    """A decode step: ``num_tokens`` requests of one query row over ``context_len`` cached."""
    from moe.layers.attention_metadata import CommonAttentionMetadata

    requests = [(context_len, 1)] * num_tokens
    return CommonAttentionMetadata.for_requests(requests, block_size)[0]


def _median_ms(fns, reps: int) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        order = range(len(fns)) if rep % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="launch.benchmarks.graph_mode", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=None, help="HF checkpoint (default: the embedded model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-tokens", type=int, nargs="+", default=[8, 40, 80])
    p.add_argument("--context-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)

    from launch.engine.arg_utils import EngineArgs
    from launch.engine.graph_mode import graph_cache_dir
    from moe import build_model, init_random_weights, load_checkpoint
    from moe.compilation import GraphModeModel

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", graph_cache_dir())
    resolved = EngineArgs(model=ns.model, dtype=ns.dtype).resolve_model()
    dtype = getattr(torch, ns.dtype)
    model = build_model(resolved.config, dtype=dtype)
    if ns.model:
        load_checkpoint(model, ns.model)
    else:
        init_random_weights(model, seed=0)
    block_size = 16
    num_blocks = max(ns.num_tokens) * (-(-(ns.context_len + 1) // block_size))
    model.allocate_kv_caches(num_blocks, block_size, dtype=dtype)
    graph = GraphModeModel(model, tuple(sorted(set(ns.num_tokens))))
    stats = graph.capture(progress=True)
    print(f"{stats.num_graphs} graphs in {stats.seconds:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in ns.num_tokens:
            meta = _metadata(n, ns.context_len, block_size)
            ids = torch.randint(3, resolved.config.vocab_size, (n,), generator=gen)
            pos = torch.full((n,), ns.context_len, dtype=torch.int64)
            args = (ids, pos, meta)
            e_f, g_f = _median_ms([lambda a=args: model(*a), lambda a=args: graph(*a)], ns.reps)
            print(
                f"n={n:4d} {ns.dtype}: forward eager {e_f:.3f} ms, graph {g_f:.3f} ms, "
                f"ratio {e_f / g_f:.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
