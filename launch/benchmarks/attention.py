"""Benchmark: paged attention on CPU, all requests at once (``forward_cpu``) vs the per-request
loop (``forward_native``), one layer, K/V write included; ``forward_cpu`` with our compiled decode
kernel (``moe.kernels``) and with plain torch only (``MOE_DBO_CPU_KERNELS=0``: every request
through the padded SDPA chunks). Prints times and ratios; speed claims live here, never in tests.

    python -m launch.benchmarks.attention [--threads 1] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch

from launch.benchmarks.timing import compiled_kernels, mean_seconds
from moe.layers.attention import PagedAttention
from moe.layers.attention_metadata import CommonAttentionMetadata

PROG = "launch.benchmarks.attention"
BLOCK_SIZE = 16
# (name, requests as (tokens already cached, query rows)), heads, kv heads, head_dim
SHAPES = (
    ("decode 80 x ctx~60, tiny heads", [(40 + i % 40, 1) for i in range(80)], 2, 1, 32),
    ("prefill 80 x ~30, tiny heads", [(0, 10 + i % 40) for i in range(80)], 2, 1, 32),
    ("decode 256 x ctx~300, 8/4 heads", [(200 + i % 200, 1) for i in range(256)], 8, 4, 32),
    ("mixed 255 decodes + chunk 512", [(100 + i, 1) for i in range(255)] + [(0, 512)], 8, 4, 32),
    # the medium checkpoint's decode steps: 80 requests, prompts of 71-249 tokens, 16/8 heads of 64
    ("decode 80 x ctx~190, 16/8 heads x 64", [(80 + i * 2, 1) for i in range(80)], 16, 8, 64),
    # 4 requests, 8/2 heads x 64: chunks over a cached context (chunked prefill), fresh prefills
    ("4 x 64 rows over 448, 8/2 heads x 64", [(448, 64)] * 4, 8, 2, 64),
    ("4 x 256 rows over 1024, 8/2 heads x 64", [(1024, 256)] * 4, 8, 2, 64),
    ("4 x 1024 rows over 0, 8/2 heads x 64", [(0, 1024)] * 4, 8, 2, 64),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(
        f"{'shape':36s} {'native ms':>10s} {'batched ms':>10s} {'torch-only ms':>14s} "
        f"{'native/batched':>15s} {'torch-only/batched':>19s}"
    )
    for name, requests, num_heads, num_kv_heads, head_dim in SHAPES:
        md, num_blocks = CommonAttentionMetadata.for_requests(requests, BLOCK_SIZE)
        op = PagedAttention(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=0.1
        )
        op.bind_kv_cache(torch.zeros(op.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=dtype))
        t = md.num_tokens
        q = torch.randn(t, num_heads * head_dim, generator=gen).to(dtype)
        k = torch.randn(t, num_kv_heads * head_dim, generator=gen).to(dtype)
        v = torch.randn(t, num_kv_heads * head_dim, generator=gen).to(dtype)
        with torch.inference_mode():
            native = mean_seconds(op.forward_native, q, k, v, md, repeats=args.repeats)
            batched = mean_seconds(op.forward_cpu, q, k, v, md, repeats=args.repeats)
            with compiled_kernels(False):
                torch_only = mean_seconds(op.forward_cpu, q, k, v, md, repeats=args.repeats)
        print(
            f"{name:36s} {native * 1e3:10.3f} {batched * 1e3:10.3f} {torch_only * 1e3:14.3f} "
            f"{native / batched:15.2f} {torch_only / batched:19.2f}"
        )


if __name__ == "__main__":
    main()
