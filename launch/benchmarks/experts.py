"""Benchmark: the experts' paths: the per-expert loop (``forward_native``), one grouped GEMM per
projection with host counts (``forward_grouped``), the host-sync-free device path
(``forward_cuda``: grouping, grouped GEMMs and combine on the device) and, on CPU, prepacked
oneDNN GEMMs per expert (``forward_cpu``). Prints times and ratios; speed claims live here, never
in tests.

    python -m launch.benchmarks.experts [--threads 1] [--repeats 20] [--device cpu|cuda]
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


def _timer(device: torch.device, repeats: int):
    """``mean_seconds`` that waits for the device after each call (CUDA runs asynchronously)."""

    def timed(fn, *args) -> float:
        if device.type != "cuda":
            return mean_seconds(fn, *args, repeats=repeats)
        return mean_seconds(lambda *a: (fn(*a), torch.cuda.synchronize()), *args, repeats=repeats)

    return timed


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.experts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timed = _timer(device, args.repeats)
    gen = torch.Generator().manual_seed(0)
    print(
        "dtype     tokens experts hidden inter topk   loop ms  grouped ms  device ms  packed ms"
        "  loop/device  device/packed"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            experts, call = _experts_and_batch(shape, dtype, device, gen)
            with torch.no_grad():
                loop = timed(experts.forward_native, *call)
                device_s = timed(experts.forward_cuda, *call)
                host_only = device.type == "cpu"  # the grouped and packed paths are CPU paths
                grouped = timed(experts.forward_grouped, *call) if host_only else float("nan")
                packed = timed(experts.forward_cpu, *call) if host_only else float("nan")
            print(
                f"{str(dtype)[6:]:9} {shape[0]:6} {shape[1]:7} {shape[2]:6} {shape[3]:5} "
                f"{shape[4]:4} {loop * 1e3:9.2f} {grouped * 1e3:11.2f} {device_s * 1e3:10.2f} "
                f"{packed * 1e3:10.2f} {loop / device_s:12.2f} {device_s / packed:14.2f}"
            )


if __name__ == "__main__":
    main()
