"""Running our Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel (Triton 3.6's
``knobs.runtime.interpret`` reads the environment on every access), so the variable must be set
before the kernels' module is imported; ``interpreted_kernels`` sets it and re-imports the module
if an earlier import compiled it for a GPU.

Triton 3.6's interpreter multiplies bfloat16 ``tl.dot`` operands as their raw 16-bit patterns
(``InterpreterBuilder.create_dot`` calls ``np.matmul`` on the uint16 storage); ``interpreted_kernels``
widens them to float32 first, which is exact (a bfloat16 is a float32 with 16 low zero bits) and
what a GPU's bfloat16 product with float32 accumulation computes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator

import numpy as np

KERNEL_MODULE = "moe.layers.triton_attention_kernels"


def _bf16_as_f32(handle):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << np.uint32(16)
    return TensorHandle(bits.view(np.float32), tl.float32)


@contextlib.contextmanager
def interpreted_kernels() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` and our kernels' module decorated under it for the block, with the
    interpreter's bfloat16 ``tl.dot`` fixed; the environment and the builder restored after."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_dot"):
        raise RuntimeError("Triton's interpreter has no InterpreterBuilder.create_dot to fix")
    original_dot = builder.create_dot
    saved_env = os.environ.get("TRITON_INTERPRET")

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(
            self, _bf16_as_f32(a), _bf16_as_f32(b), d, input_precision, max_num_imprecise_acc
        )

    os.environ["TRITON_INTERPRET"] = "1"
    builder.create_dot = create_dot
    module = sys.modules.get(KERNEL_MODULE)
    if module is not None and not isinstance(module.paged_attention_kernel, interpreter.InterpretedFunction):
        importlib.reload(module)
    try:
        yield
    finally:
        builder.create_dot = original_dot
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
