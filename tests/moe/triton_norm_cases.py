"""Cases of ``test_triton_norm``, run in a subprocess under ``TRITON_INTERPRET=1`` (Triton reads
the variable when it is imported; see ``tests.helpers.triton_interpreter``):
``python -m tests.moe.triton_norm_cases <dtype>... [--device cuda]`` exits 0 when every check
holds (on a GPU the same checks run compiled, without the interpreter).

``RMSNorm.forward_cuda`` (one Triton launch) against ``forward_native`` on the CUDA platform.
"""

from __future__ import annotations

import sys

import torch

from moe.layers import triton_attention
from moe.layers.norm import RMSNorm
from moe.layers.triton_norm import TRITON_NORM_DTYPES
from moe.platforms import CudaPlatform, set_current_platform

# float64 takes forward_native (no launch): equal. The statistics are float32 (as the
# reference's), so float32 agrees to float32's summation order and rsqrt rounding (a few 2^-24);
# float16 and bfloat16 to about an ulp (2^-10, 2^-7) of the normalised value, times the weight,
# plus the product's rounding
TOLERANCE = {
    torch.float64: 0.0,
    torch.float32: 2**-20,
    torch.float16: 2**-8,
    torch.bfloat16: 2**-5,
}


def _inputs(dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """(name, x, hidden_size): rows of a power-of-2 width, a 3-D input of width 96, a strided
    view of a wider projection output, a width below the kernel's least block, no rows."""

    def randn(*shape: int) -> torch.Tensor:
        return (3 * torch.randn(*shape, generator=gen) + 0.5).to(device, dtype)

    yield "rows", randn(7, 256), 256
    yield "3-D", randn(3, 5, 96), 96
    yield "strided view", randn(6, 320)[:, 64:224], 160
    yield "narrow", randn(4, 8), 8
    yield "empty", randn(0, 64), 64


def check(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    launches = []
    launch = triton_attention.launch

    def counted_launch(kernel, grid, **kwargs):
        launches.append(grid)
        launch(kernel, grid, **kwargs)

    triton_attention.launch = counted_launch
    weight_dtypes = [dtype] + ([torch.float32] if dtype == torch.bfloat16 else [])
    for name, x, hidden_size in _inputs(dtype, device, gen):
        for weight_dtype in weight_dtypes:
            norm = RMSNorm(hidden_size, eps=1e-5, dtype=weight_dtype, device=device)
            assert norm.forward_path == "forward_cuda"
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(hidden_size, generator=gen))
            del launches[:]
            with torch.no_grad():
                out, ref = norm(x), norm.forward_native(x)
            if len(launches) != (1 if x.numel() and dtype in TRITON_NORM_DTYPES else 0):
                raise AssertionError(f"{name}: {len(launches)} launches")
            if out.shape != ref.shape or out.dtype != ref.dtype:
                raise AssertionError(f"{name}: {out.shape} {out.dtype} != {ref.shape} {ref.dtype}")
            bound = TOLERANCE[dtype] * max(1.0, float(ref.abs().max()) if ref.numel() else 0.0)
            err = float((out.double() - ref.double()).abs().max()) if ref.numel() else 0.0
            label = f"{name} {dtype} weight {weight_dtype}"
            if not err <= bound:
                raise AssertionError(f"{label}: max error {err:.3g} > {bound:.3g}")
            print(f"{label}: max error {err:.3g} <= {bound:.3g}")


def main(argv: list[str]) -> None:
    device = torch.device("cpu")
    if "--device" in argv:
        at = argv.index("--device")
        device, argv = torch.device(argv[at + 1]), argv[:at] + argv[at + 2 :]
    set_current_platform(CudaPlatform())  # the ops bind forward_cuda (on CPU tensors too)
    for name in argv:
        check(getattr(torch, name), device)


if __name__ == "__main__":
    main(sys.argv[1:])
