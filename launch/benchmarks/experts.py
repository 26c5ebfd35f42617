"""Benchmark: experts on CPU: the per-expert loop (``forward_native``), one grouped GEMM per
projection (``forward_grouped``) and prepacked oneDNN GEMMs per expert (``forward_cpu``). Prints
times and ratios; speed claims live here, never in tests.

    python -m launch.benchmarks.experts [--threads 1] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch

from launch.benchmarks.timing import mean_seconds
from moe.fused_moe.experts import TorchExperts

# (tokens, local experts, hidden, expert intermediate, top-k): embedded default, DeepSeek-V2-Lite-
# like (64 experts, top-6, per-rank half) at small and decode-sized batches
SHAPES = (
    (256, 8, 256, 512, 2),
    (64, 8, 256, 512, 2),
    (512, 32, 512, 256, 6),
    (32, 32, 512, 256, 6),
    (80, 8, 1024, 2048, 2),  # the medium checkpoint: a decode batch, a prefill chunk
    (2048, 8, 1024, 2048, 2),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.experts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(
        "dtype     tokens experts hidden inter topk   loop ms  grouped ms  packed ms  "
        "loop/packed  grouped/packed"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for num_tokens, num_experts, hidden, inter, top_k in SHAPES:
            experts = TorchExperts(
                num_local_experts=num_experts,
                hidden_size=hidden,
                intermediate_size=inter,
                dtype=dtype,
            )
            with torch.no_grad():
                for p in experts.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * hidden**-0.5)
            experts.process_weights_after_loading()
            x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
            # half the slots are routed to another EP rank (-1), as with EP=2
            ids = torch.randint(-num_experts, num_experts, (num_tokens, top_k), generator=gen)
            ids = ids.clamp(min=-1)
            weights = torch.rand(num_tokens, top_k, generator=gen)
            with torch.no_grad():
                call = (x, ids, weights)
                loop = mean_seconds(experts.forward_native, *call, repeats=args.repeats)
                grouped = mean_seconds(experts.forward_grouped, *call, repeats=args.repeats)
                packed = mean_seconds(experts.forward_cpu, *call, repeats=args.repeats)
            print(
                f"{str(dtype)[6:]:9} {num_tokens:6} {num_experts:7} {hidden:6} {inter:5} {top_k:4} "
                f"{loop * 1e3:9.2f} {grouped * 1e3:11.2f} {packed * 1e3:10.2f} "
                f"{loop / packed:12.2f} {grouped / packed:15.2f}"
            )


if __name__ == "__main__":
    main()
