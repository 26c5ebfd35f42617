"""Benchmark: paged attention of one layer, K/V write included, per attention backend.

Runs each backend the device's platform runs and the per-request loop (``forward_native``), and
prints ms per call, ratios to the platform's default and each backend's fraction of the memory
roofline. Speed claims live here, never in tests. docs/benchmarks.md#micro-benchmarks."""

from __future__ import annotations

import argparse

import torch

from launch.benchmarks.roofline import copy_bandwidth
from launch.benchmarks.timing import device_timer
from moe.layers.attention import PagedAttention
from moe.layers.attention_backend import AttentionBackendEnum
from moe.layers.attention_metadata import CommonAttentionMetadata
from moe.layers.attention_selector import set_attention_backend
from moe.platforms import current_platform, set_current_platform
from moe.platforms.plugins import BUILTIN_PLATFORMS

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
    # OLMoE-1B-7B's attention (16 heads of 128) at decode batch 256 over 128-token prompts
    (
        "decode 256 x ctx~160, 16/16 heads x 128",
        [(128 + i % 64, 1) for i in range(256)],
        16,
        16,
        128,
    ),
)


def bytes_moved(md: CommonAttentionMetadata, num_heads, num_kv_heads, head_dim, dtype) -> int:
    """The bytes one call must move at least: the cached K/V of every request's context read
    (this step's rows included), the new K/V written, the queries read, the output written."""
    element = torch.empty((), dtype=dtype).element_size()
    kv_row = 2 * num_kv_heads * head_dim * element
    rows = md.num_actual_tokens
    return (
        int(md.seq_lens.sum()) * kv_row + rows * kv_row + 2 * rows * num_heads * head_dim * element
    )


def _time_backends(shape, md, num_blocks, backends, device, dtype, timed, gen) -> dict[str, float]:
    """Seconds per call of ``forward_native`` and of each backend's ``forward`` on one shape
    (its metadata ``md`` over a cache of ``num_blocks``)."""
    _, _, num_heads, num_kv_heads, head_dim = shape
    q, k, v = (
        torch.randn(md.num_tokens, h * head_dim, generator=gen).to(device, dtype)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    times = {}
    for name in ("native", *backends):
        set_attention_backend(None if name == "native" else AttentionBackendEnum(name))
        op = PagedAttention(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=0.1
        )
        cache = torch.zeros(op.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=dtype, device=device)
        op.bind_kv_cache(cache)
        with torch.inference_mode():
            times[name] = timed(op.forward_native if name == "native" else op, q, k, v, md)
    set_attention_backend(None)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_current_platform(BUILTIN_PLATFORMS[args.device]())
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backends = current_platform().attention_backends  # the default first
    timed = device_timer(device, args.repeats)
    bandwidth = copy_bandwidth(device, lambda: current_platform().synchronize(device))
    print(f"{PROG}: {args.device} {args.dtype}, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    ratios = [f"native/{backends[0]}", *(f"{b}/{backends[0]}" for b in backends[1:])]
    print(
        f"{'shape':40s} {'native ms':>10s} "
        + " ".join(f"{b + ' ms':>17s}" for b in backends)
        + " "
        + " ".join(f"{r:>25s}" for r in ratios)
        + " "
        + " ".join(f"{b + ' roofline':>23s}" for b in backends)
    )
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        md, num_blocks = CommonAttentionMetadata.for_requests(shape[1], BLOCK_SIZE)
        t = _time_backends(shape, md, num_blocks, backends, device, dtype, timed, gen)
        floor = bytes_moved(md, *shape[2:], dtype) / bandwidth
        print(
            f"{shape[0]:40s} {t['native'] * 1e3:10.3f} "
            + " ".join(f"{t[b] * 1e3:17.3f}" for b in backends)
            + f" {t['native'] / t[backends[0]]:25.2f} "
            + " ".join(f"{t[b] / t[backends[0]]:25.2f}" for b in backends[1:])
            + " "
            + " ".join(f"{floor / t[b]:23.1%}" for b in backends)
        )


if __name__ == "__main__":
    main()
