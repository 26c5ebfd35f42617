"""Benchmark: which CPU kernel serves the model's linear layers fastest. ``F.linear`` in float32
(MKL sgemm) and bfloat16 (oneDNN, AMX / avx512_bf16 where the CPU has them), and float32 through a
prepacked oneDNN linear (``torch.utils.mkldnn.to_mkldnn``). Prints times and ratios; the engine
uses plain ``F.linear`` because the prepacked path measured no faster.

    python -m launch.benchmarks.linear [--threads 1] [--repeats 10]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import mkldnn as mkldnn_utils

from launch.benchmarks.timing import mean_seconds

PROG = "launch.benchmarks.linear"
# (tokens, in_features, out_features): tiny checkpoint decode, medium checkpoint decode and
# prefill (hidden 1024, expert intermediate 2048)
SHAPES = ((80, 64, 512), (80, 1024, 2048), (1024, 1024, 2048))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"mkldnn available {torch.backends.mkldnn.is_available()}"
    )
    print(
        f"{'tokens x in x out':20s} {'fp32 ms':>9s} {'bf16 ms':>9s} {'fp32 packed ms':>15s} "
        f"{'fp32/bf16':>10s} {'fp32/packed':>12s}"
    )
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for num_tokens, in_features, out_features in SHAPES:
            x = torch.randn(num_tokens, in_features, generator=gen)
            linear = nn.Linear(in_features, out_features, bias=False)
            packed = mkldnn_utils.to_mkldnn(nn.Sequential(linear))
            w_bf16, x_bf16 = linear.weight.bfloat16(), x.bfloat16()
            fp32 = mean_seconds(F.linear, x, linear.weight, repeats=args.repeats)
            bf16 = mean_seconds(F.linear, x_bf16, w_bf16, repeats=args.repeats)
            prepacked = mean_seconds(packed, x, repeats=args.repeats)
            shape = f"{num_tokens} x {in_features} x {out_features}"
            print(
                f"{shape:20s} {fp32 * 1e3:9.3f} {bf16 * 1e3:9.3f} {prepacked * 1e3:15.3f} "
                f"{fp32 / bf16:10.2f} {fp32 / prepacked:12.2f}"
            )


if __name__ == "__main__":
    main()
