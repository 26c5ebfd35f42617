"""Benchmark: the CPU linear kernels of ``moe.layers.Linear``, plain against prepacked.

Per shape and dtype (float32, bfloat16): ``F.linear`` (``forward_native``) against the prepacked
oneDNN weight ``forward_cpu`` serves from (rows padded to a bucket; float32 batches above
``FLOAT32_MAX_PACKED_ROWS`` rows stay on ``F.linear``); prints times and the ratio native / cpu
(> 1: the CPU path is faster). docs/benchmarks.md#micro-benchmarks."""

from __future__ import annotations

import argparse

import torch

from launch.benchmarks.timing import mean_seconds
from moe.layers.linear import Linear, packing_unavailable_reason

PROG = "launch.benchmarks.linear"
# (tokens, in_features, out_features): the medium checkpoint's decode expert rows (20), decode
# batch (80), prefill expert rows (512) and prefill chunk (2048) at hidden 1024 and expert
# intermediate 2048 ([w1; w3] is 4096 wide), and its lm_head (32000 wide) at decode
SHAPES = (
    (20, 1024, 4096),
    (80, 1024, 4096),
    (512, 1024, 4096),
    (2048, 1024, 4096),
    (20, 2048, 1024),
    (512, 2048, 1024),
    (80, 1024, 32000),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, oneDNN packing: "
        f"{packing_unavailable_reason() or 'available'}"
    )
    print(f"{'dtype':9s} {'tokens x in x out':20s} {'native ms':>10s} {'cpu ms':>8s} {'ratio':>6s}")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for num_tokens, in_features, out_features in SHAPES:
                layer = Linear(in_features, out_features, bias=False, dtype=dtype)
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.03)
                layer.process_weights_after_loading()
                x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
                native = mean_seconds(layer.forward_native, x, repeats=args.repeats)
                cpu = mean_seconds(layer.forward_cpu, x, repeats=args.repeats)
                shape = f"{num_tokens} x {in_features} x {out_features}"
                print(
                    f"{str(dtype)[6:]:9s} {shape:20s} {native * 1e3:10.3f} {cpu * 1e3:8.3f} "
                    f"{native / cpu:6.2f}"
                )


if __name__ == "__main__":
    main()
