"""The experts on the device through our Triton fused-MoE kernels (``forward_cuda`` with
``MOE_DBO_CUDA_EXPERTS=triton``), after vLLM's ``fused_experts``: ``align_pairs``, the block sizes
and ``fused_experts``, nothing read to the host. Triton is imported only when this path runs
(``runs`` says whether it can). The four steps: docs/hardware.md#triton-experts-steps-and-rounding.

Legend: N = rows, K = num_topk, E = num_local_experts, H = hidden_size, F = intermediate_size,
P = N * K (row, slot) pairs, B = BLOCK_M (pairs per block, one expert per block)."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

from moe.fused_moe.grouped_experts import ExpertWeights, expert_keys

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_BLOCK = 16  # tl.dot's smallest block side


@dataclass(frozen=True, slots=True, kw_only=True)
class AlignedPairs:
    """The pairs in blocks of ``block_m`` positions, one group per block, on the device: groups
    0..E-1 are the local experts, group E the pairs of no local expert (last).

    ``sorted_pair_ids``: ``[num_blocks * block_m]`` int64 flat pair index (row * K + slot) at
    each position, P at padding; ``block_expert_ids``: ``[num_blocks]`` int64 group of each
    block (unspecified past ``num_padded``); ``num_padded``: ``[1]`` int64 positions in use, all
    groups (a multiple of block_m); blocks at or past it hold nothing."""

    sorted_pair_ids: Tensor
    block_expert_ids: Tensor
    num_padded: Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert_ids.shape[0]


def align_pairs(topk_ids: Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """vLLM's ``moe_align_block_size`` for ``topk_ids`` ``[N, K]`` (int64 local ids; ids outside
    ``[0, E)`` are no local expert: group E) with no host read, in 17 ops whatever N: each
    group's pairs in (row, slot) order (a stable sort), the group padded to a multiple of
    ``block_m``.

    Raises:
        ValueError: ``block_m`` not a power of two.
    """
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    sorted_keys, order = torch.sort(expert_keys(topk_ids, num_experts), stable=True)
    # starts[g] = first position of group g (g = 0..E+1: starts[E + 1] = P)
    groups = torch.arange(num_experts + 2, device=device)
    starts = torch.searchsorted(sorted_keys, groups)
    counts = starts[1:] - starts[:-1]  # [E + 1]
    padded_counts = (counts + (block_m - 1)).bitwise_and_(-block_m)
    padded_ends = torch.cumsum(padded_counts, 0)
    # position i of group g moves by the padding before g: padded_start[g] - start[g]
    shift = (padded_ends - padded_counts).sub_(starts[:-1])
    dest = torch.arange(num_pairs, device=device).add_(shift[sorted_keys])
    num_blocks = -(-(num_pairs + (num_experts + 1) * (block_m - 1)) // block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, device=device)
    sorted_pair_ids.scatter_(0, dest, order)
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=device)
    return AlignedPairs(
        sorted_pair_ids=sorted_pair_ids,
        block_expert_ids=torch.searchsorted(padded_ends, block_starts, right=True),
        num_padded=padded_ends[-1:],
        block_m=block_m,
    )


@functools.cache
def triton_available() -> bool:
    """Whether the triton package can be found (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def runs(hidden_states: Tensor, weights: ExpertWeights) -> bool:
    """Whether ``fused_experts`` runs these operands: triton installed, one dtype of
    ``TRITON_DTYPES`` for rows and weights, w1 and w3 with the same strides."""
    dtype = hidden_states.dtype
    return (
        dtype in TRITON_DTYPES
        and weights.w1.dtype == dtype
        and weights.w1.stride() == weights.w3.stride()
        and triton_available()
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockConfig:
    """Tile sizes of both kernels (vLLM's default config: small blocks when there are no more
    rows than experts, as in decode)."""

    block_m: int
    block_n: int
    block_k: int

    @classmethod
    def for_shape(cls, num_tokens: int, num_experts: int, hidden: int, inter: int) -> BlockConfig:
        small = num_tokens <= num_experts
        return cls(
            block_m=16 if small else 64,
            block_n=_fit(32 if small else 64, min(hidden, inter)),
            block_k=_fit(64 if small else 32, min(hidden, inter)),
        )


def _fit(block: int, size: int) -> int:
    """``block`` shrunk to the next power of two >= ``size`` (at least ``MIN_BLOCK``)."""
    return max(MIN_BLOCK, min(block, 1 << max(0, size - 1).bit_length()))


def fused_experts(
    hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights
) -> Tensor:
    """Σ_k topk_weights[n, k] · SwiGLU_expert(topk_ids[n, k])(hidden_states[n]) through the
    Triton kernels (module docstring), with no host read. Check ``runs`` first.

    Args:
        hidden_states: ``[N, H]`` in the weights' dtype, N >= 0.
        topk_ids: ``[N, K]`` int64 local ids, K >= 1; ids outside ``[0, E)`` add nothing.
        topk_weights: ``[N, K]`` any float dtype (rounded to hidden_states' dtype, as the
            reference).

    Returns:
        ``[N, H]`` in hidden_states' dtype.
    """
    from moe.fused_moe import triton_kernels as kernels  # triton: only on this path

    num_tokens, num_topk = topk_ids.shape
    num_experts, inter, hidden = weights.w1.shape
    num_pairs = topk_ids.numel()
    config = BlockConfig.for_shape(num_tokens, num_experts, hidden, inter)
    aligned = align_pairs(topk_ids, num_experts, config.block_m)
    dtype = hidden_states.dtype
    dot = {
        "DOT_FLOAT32": kernels.is_interpreted() and dtype != torch.float32,
        "IEEE": dtype == torch.float32,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
    }
    blocks = (
        aligned.sorted_pair_ids, aligned.block_expert_ids, aligned.num_padded, num_pairs,
        num_experts,
    )  # fmt: skip
    h = hidden_states.new_empty(num_pairs, inter)
    w1, w2, w3 = weights.w1, weights.w2, weights.w3
    launch(
        kernels.gate_up_silu_kernel,
        (aligned.num_blocks, -(-inter // config.block_n)),
        hidden_states, w1, w3, h, *blocks,
        *hidden_states.stride(), *w1.stride(), *h.stride(),
        TOP_K=num_topk, N=inter, K=hidden, **dot,
    )  # fmt: skip
    y = hidden_states.new_empty(num_pairs, hidden)  # every pair written: group E as zeros
    launch(
        kernels.down_weighted_kernel,
        (aligned.num_blocks, -(-hidden // config.block_n)),
        h, w2, y, topk_weights.reshape(-1).to(torch.float32), *blocks,
        *h.stride(), *w2.stride(), *y.stride(),
        N=hidden, K=inter, **dot,
    )  # fmt: skip
    return y.view(num_tokens, num_topk, hidden).sum(dim=1)


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``: one Triton launch (one place to count them)."""
    kernel[grid](*args, **meta)
