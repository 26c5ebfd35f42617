"""Benchmark: the experts' paths against each other, times and ratios.

The per-expert loop, grouped GEMMs with host counts, the host-sync-free device path and, on CPU,
``forward_cpu`` with our compiled kernels off and on; ``--cuda-backends`` sets
``torch._grouped_mm`` against our Triton kernels. Speed claims live here, never in tests.
docs/benchmarks.md#micro-benchmarks, docs/hardware.md#experts-on-the-cuda-path."""

from __future__ import annotations

import argparse
import functools

import torch

from launch.benchmarks.timing import compiled_kernels, device_timer
from moe.fused_moe import cpu_experts, triton_experts
from moe.fused_moe.experts import TorchExperts
from moe.fused_moe.grouped_experts import grouped_experts, grouped_mm_runs
from moe.platforms.device_probes import is_host

# (tokens, local experts, hidden, expert intermediate, top-k): embedded default, DeepSeek-V2-Lite-
# like (64 experts, top-6, per-rank half) at small and decode-sized batches
SHAPES = (
    (256, 8, 256, 512, 2),
    (64, 8, 256, 512, 2),
    (512, 32, 512, 256, 6),
    (32, 32, 512, 256, 6),
    (80, 8, 1024, 2048, 2),  # the medium checkpoint: a decode batch, a prefill chunk
    (2048, 8, 1024, 2048, 2),
    (80, 60, 512, 352, 4),  # Qwen1.5-MoE-like experts (the shape sweep's worst float32 row)
    (2048, 60, 512, 352, 4),
)
# OLMoE-like experts (64 of hidden 2048, F = 1024, top-8) at decode and prefill batch sizes
CUDA_SHAPES = (*SHAPES, (8, 64, 2048, 1024, 8), (256, 64, 2048, 1024, 8), (4096, 64, 2048, 1024, 8))


def _experts_and_batch(shape, dtype, device, gen):
    num_tokens, num_experts, hidden, inter, top_k = shape
    experts = TorchExperts(
        num_local_experts=num_experts, hidden_size=hidden, intermediate_size=inter, dtype=dtype
    )
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * hidden**-0.5)
    experts = experts.to(device)
    experts.process_weights_after_loading()
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    # half the slots are routed to another EP rank (-1), as with EP=2
    ids = torch.randint(-num_experts, num_experts, (num_tokens, top_k), generator=gen)
    ids = ids.clamp(min=-1)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return experts, (x.to(device), ids.to(device), weights.to(device))


def _time_paths(shape, dtype, device, timed, gen) -> dict[str, float]:
    """Seconds per call of each path on one shape (NaN where a path is not a CPU path here)."""
    with compiled_kernels(False):
        experts, call = _experts_and_batch(shape, dtype, device, gen)
    host_only = is_host(device)  # the grouped, per-expert and kernel paths are CPU paths
    nan = float("nan")
    with torch.no_grad():
        times = {"loop": timed(experts.forward_native, *call)}
        times["device"] = timed(experts.forward_cuda, *call)
        grouped = functools.partial(cpu_experts.forward_grouped, experts)
        times["grouped"] = timed(grouped, *call) if host_only else nan
        with compiled_kernels(False):
            times["packed"] = timed(experts.forward_cpu, *call) if host_only else nan
        experts.process_weights_after_loading()  # the kernel's packs, where it serves
        times["kernel"] = timed(experts.forward_cpu, *call) if host_only else nan
    return times


def compare_cuda_backends(dtype, device, timed, gen) -> None:
    """Print, per shape of ``CUDA_SHAPES``, ``forward_cuda``'s two implementations' times and
    their ratio (NaN where one cannot run these operands)."""
    print("dtype     tokens experts hidden inter topk  grouped_mm ms  triton ms  grouped/triton")
    for shape in CUDA_SHAPES:
        experts, (x, ids, weights) = _experts_and_batch(shape, dtype, device, gen)
        w = experts.expert_weights()
        nan = float("nan")
        with torch.no_grad():
            grouped = timed(grouped_experts, x, ids, weights, w) if grouped_mm_runs(x, w) else nan
            fused = triton_experts.fused_experts
            triton = timed(fused, x, ids, weights, w) if triton_experts.runs(x, w) else nan
        print(
            f"{str(dtype)[6:]:9} {shape[0]:6} {shape[1]:7} {shape[2]:6} {shape[3]:5} {shape[4]:4} "
            f"{grouped * 1e3:14.3f} {triton * 1e3:10.3f} {grouped / triton:15.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.experts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--cuda-backends",
        action="store_true",
        help="time forward_cuda's torch._grouped_mm against our Triton kernels (ratio)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timed = device_timer(device, args.repeats)
    gen = torch.Generator().manual_seed(0)
    if args.cuda_backends:
        for dtype in (torch.bfloat16, torch.float32):
            compare_cuda_backends(dtype, device, timed, gen)
        return
    print(
        "dtype     tokens experts hidden inter topk   loop ms  grouped ms  device ms  packed ms"
        "  kernel ms  loop/device  packed/kernel"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            t = {k: v * 1e3 for k, v in _time_paths(shape, dtype, device, timed, gen).items()}
            print(
                f"{str(dtype)[6:]:9} {shape[0]:6} {shape[1]:7} {shape[2]:6} {shape[3]:5} "
                f"{shape[4]:4} {t['loop']:9.2f} {t['grouped']:11.2f} {t['device']:10.2f} "
                f"{t['packed']:10.2f} {t['kernel']:10.2f} {t['loop'] / t['device']:12.2f} "
                f"{t['packed'] / t['kernel']:14.2f}"
            )


if __name__ == "__main__":
    main()
