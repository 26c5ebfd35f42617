"""RMSNorm in one Triton launch (``RMSNorm.forward_cuda``): one program per row, after vLLM's
``rms_norm`` kernel (``csrc/layernorm_kernels.cu``, one block per token). Launches go through
``moe.layers.triton_attention.launch`` and are possible where its ``launches_on`` says so (one
definition of both)."""

from __future__ import annotations

import torch
from torch import Tensor

from moe.layers import triton_attention

# dtypes the kernel takes (x and weight). Not float64: its reference keeps float32 statistics
# (as transformers), so only torch's own summation order reproduces it exactly, and float64 is
# where the models are compared exactly (forward_cpu leaves float64 to forward_native too)
TRITON_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def can_launch_rms_norm(x: Tensor, weight: Tensor) -> bool:
    """Whether ``triton_rms_norm`` can run on these tensors in this process: Triton launches
    (``triton_attention.launches_on``) on x's device (compiled kernels take CUDA tensors, Triton's
    interpreter CPU ones: the CUDA op paths on CPU tensors of a GPU machine stay in torch), both
    dtypes are in ``TRITON_NORM_DTYPES``, and the tensors share a device."""
    return (
        x.dtype in TRITON_NORM_DTYPES
        and weight.dtype in TRITON_NORM_DTYPES
        and x.device == weight.device
        and triton_attention.launches_on(x.device)
    )


def triton_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * rms_normalize(x)`` in one launch (plus the output's allocation).

    x: [..., hidden_size], a dtype of ``TRITON_NORM_DTYPES`` (rows may be strided: a view of a
    wider projection output stays a view); weight: [hidden_size]. Returns [..., hidden_size] in
    ``promote_types(x.dtype, weight.dtype)``, contiguous. Equals ``RMSNorm.forward_native`` up to
    float32 summation order and ``rsqrt``'s rounding (statistics in float32 for every dtype).

    Raises:
        ValueError: weight is not [hidden_size].
    """
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight shape {tuple(weight.shape)} is not ({hidden_size},)")
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # torch.promote_types is an ATen call too: skip it in the common case of equal dtypes
    same = x.dtype == weight.dtype
    out_dtype = x.dtype if same else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block_n = triton_attention._pow2(hidden_size)
        triton_attention.launch(
            _kernels().rms_norm_kernel,
            (rows.shape[0],),
            x_ptr=rows,
            weight_ptr=weight,
            out_ptr=out,
            x_row_stride=rows.stride(0),
            hidden_size=hidden_size,
            eps=eps,
            BLOCK_N=block_n,
            num_warps=4 if block_n <= 2048 else 8,
        )
    return out.view(*x.shape[:-1], hidden_size)


def _kernels():
    from moe.layers import triton_norm_kernels  # imports Triton: only when a norm launches

    return triton_norm_kernels
