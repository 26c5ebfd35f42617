"""Running our Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

Triton decides at import time: ``triton.language``'s own helpers (``tl.zeros``, ...) are
``@triton.jit`` functions, interpreted only if the variable was set when Triton was imported, and
torch imports Triton with inductor. So the kernels run in a fresh interpreter
(``run_interpreted``) with the variable set from its start.

Triton 3.6's interpreter multiplies bfloat16 ``tl.dot`` operands as their raw 16-bit patterns
(``InterpreterBuilder.create_dot`` calls ``np.matmul`` on the uint16 storage);
``fixed_bfloat16_dot`` widens them to float32 first, which is exact (a bfloat16 is a float32 with
16 low zero bits) and what a GPU's bfloat16 product with float32 accumulation computes.

``compile_for_sm90`` compiles a launch's kernel for Hopper instead of running it (no GPU needed).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import torch


def run_interpreted(
    module: str, *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> str:
    """``python -m module args...`` under ``TRITON_INTERPRET=1`` (or with ``env`` added to this
    process's environment instead, e.g. ``{}`` to compile for a GPU); its output (stdout +
    stderr).

    Raises:
        AssertionError: it exited non-zero (with its output).
    """
    from tests.helpers.distributed import REPO

    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if env is None else env)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(  # from the repository root, whatever directory a test left
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{module} {' '.join(args)} failed:\n{output[-6000:]}"
    return output


def _bf16_as_f32(handle):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << np.uint32(16)
    return TensorHandle(bits.view(np.float32), tl.float32)


@contextlib.contextmanager
def fixed_bfloat16_dot() -> Iterator[None]:
    """The interpreter's ``tl.dot`` with bfloat16 operands widened to float32 for the block.

    Raises:
        RuntimeError: not under ``TRITON_INTERPRET=1``, or Triton's interpreter changed shape.
    """
    import triton
    from triton.runtime import interpreter

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton")
    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_dot"):
        raise RuntimeError("Triton's interpreter has no InterpreterBuilder.create_dot to fix")
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = _bf16_as_f32(a), _bf16_as_f32(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


_POINTEE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _arg_type(value):
    """Triton's type string of a launch argument (a tuple of them for a tuple)."""
    if isinstance(value, tuple):
        return tuple(_arg_type(v) for v in value)
    if isinstance(value, torch.Tensor):
        return "*" + _POINTEE[value.dtype]
    if isinstance(value, float):
        return "fp32"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def compile_for_sm90(compiled: list[str]):
    """A stand-in for a module's ``launch(kernel, grid, **kwargs)`` that compiles the kernel for
    sm90 (Hopper) down to a cubin with Triton's bundled ptxas, no GPU needed, instead of running
    it; appends the kernel's name to ``compiled``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_launch(kernel, grid, *, num_warps=4, **kwargs):
        constexprs = {kernel.arg_names[i] for i in kernel.constexprs}
        signature, constants = {}, {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name], constants[name] = "constexpr", kwargs[name]
            else:
                signature[name] = _arg_type(kwargs[name])
        source = ASTSource(kernel, signature, constants)
        binary = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
        )
        assert binary.asm["cubin"]
        compiled.append(kernel.__name__)

    return compile_launch
