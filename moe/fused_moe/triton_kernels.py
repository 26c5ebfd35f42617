"""The Triton kernels of ``moe.fused_moe.triton_experts`` (imported only when that path runs), after
vLLM's ``fused_moe_kernel``: ``gate_up_silu_kernel`` (row gather and SiLU-and-mul folded into the
first GEMM) and ``down_weighted_kernel`` (the routing weight in the second GEMM's epilogue). Blocks,
rounding, ``DOT_FLOAT32`` and ``IEEE``: docs/hardware.md#triton-experts-steps-and-rounding."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, DOT_FLOAT32: tl.constexpr, IEEE: tl.constexpr):
    if DOT_FLOAT32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:  # noqa: SIM108  (a constexpr branch: the other dot is never compiled)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def gate_up_silu_kernel(
    x_ptr,  # [N, H] rows
    w1_ptr,  # [E, F, H] gate
    w3_ptr,  # [E, F, H] up (same strides as w1)
    h_ptr,  # [P, F] out: silu(x W1_e^T) * (x W3_e^T) per pair
    sorted_pair_ids_ptr,  # [num_blocks * BLOCK_M] pair index; num_pairs = padding
    block_expert_ids_ptr,  # [num_blocks] expert of each block
    num_padded_ptr,  # [1] pairs after padding (blocks at or past it do nothing)
    num_pairs,
    num_experts,  # blocks of group num_experts hold pairs of no local expert
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_hn,
    TOP_K: tl.constexpr,
    N: tl.constexpr,  # F
    K: tl.constexpr,  # H
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FLOAT32: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:  # no local expert: h is not read for these pairs
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    is_pair = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_offs = expert * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        a = tl.load(x_ptrs, mask=is_pair[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & (offs_n[None, :] < N)
        gate = _dot(a, tl.load(w1_ptr + w_offs, mask=w_mask, other=0.0), gate, DOT_FLOAT32, IEEE)
        up = _dot(a, tl.load(w3_ptr + w_offs, mask=w_mask, other=0.0), up, DOT_FLOAT32, IEEE)
        x_ptrs += BLOCK_K * stride_xk
        w_offs += BLOCK_K * stride_wk
    dtype = h_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + pair[:, None] * stride_hm + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(dtype), mask=is_pair[:, None] & (offs_n[None, :] < N))


@triton.jit
def down_weighted_kernel(
    h_ptr,  # [P, F] from gate_up_silu_kernel
    w2_ptr,  # [E, H, F] down
    y_ptr,  # [P, H] out: topk_weight[pair] * (h W2_e^T)
    topk_weights_ptr,  # [P] float32, pair order
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    N: tl.constexpr,  # H
    K: tl.constexpr,  # F
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FLOAT32: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    is_pair = pair < num_pairs
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + pair[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = is_pair[:, None] & (offs_n[None, :] < N)
    dtype = y_ptr.dtype.element_ty
    if expert >= num_experts:  # pairs of no local expert add nothing: zeros
        tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=dtype), mask=y_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair[:, None] * stride_hm + offs_k[None, :] * stride_hk
    w_offs = expert * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        a = tl.load(h_ptrs, mask=is_pair[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & (offs_n[None, :] < N)
        acc = _dot(a, tl.load(w2_ptr + w_offs, mask=w_mask, other=0.0), acc, DOT_FLOAT32, IEEE)
        h_ptrs += BLOCK_K * stride_hk
        w_offs += BLOCK_K * stride_wk
    weight = tl.load(topk_weights_ptr + pair, mask=is_pair, other=0.0).to(dtype).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(y_ptrs, y.to(dtype), mask=y_mask)


def is_interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module
    was imported): the decorated objects say, whatever the environment says now."""
    return type(gate_up_silu_kernel).__name__ == "InterpretedFunction"
