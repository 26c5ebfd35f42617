"""The experts on the device without reading anything to the host (``TorchExperts.forward_cuda`` and
the device path of ``apply_batched``), so a CUDA graph can capture them: ``grouped_experts``
(``torch._grouped_mm``), ``dense_experts`` where it cannot run without a host read, and
``batched_experts`` for the batched format. docs/hardware.md#experts-on-the-cuda-path.

Legend: N = rows, K = num_topk, E = num_local_experts, H = hidden_size, F = intermediate_size,
P = N * K (row, slot) pairs, M = max_tokens_per_expert."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from moe.layers.activation import swiglu
from moe.platforms.device_probes import grouped_mm_unavailable

# ``dense_experts`` holds [E, N, max(2F, H)] values at once: at most this many (256 MiB in
# float32); above it the caller runs the reference (which reads the counts to the host)
DENSE_MAX_ELEMENTS = 1 << 26

# ``mm(rows, weights_EKN)``: the per-expert product (a grouped GEMM with offsets, or a batched one)
ExpertMatmul = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The SwiGLU weights of E experts: ``w1`` (gate) and ``w3`` (up) ``[E, F, H]``, ``w2``
    (down) ``[E, H, F]``, all of one dtype and device."""

    w1: Tensor
    w2: Tensor
    w3: Tensor

    @property
    def gate_up(self) -> Tensor | None:
        """``[w1; w3]`` as one ``[E, 2F, H]`` view where w3 follows w1 in each expert's rows of
        one storage (``TorchExperts`` allocates them so), else None (e.g. after ``module.to``, or
        while graph mode traces them as two inputs)."""
        w1, w3 = self.w1, self.w3
        num_experts, inter, hidden = w1.shape
        strides = (2 * inter * hidden, hidden, 1)
        if w1.is_meta or w3.shape != w1.shape or not w1.stride() == w3.stride() == strides:
            return None
        try:
            same_storage = w1.untyped_storage().data_ptr() == w3.untyped_storage().data_ptr()
        except RuntimeError:  # traced (graph mode): w1 and w3 are two inputs of the graph
            return None
        if not same_storage or w3.storage_offset() != w1.storage_offset() + inter * hidden:
            return None
        return w1.as_strided((num_experts, 2 * inter, hidden), strides)

    def swiglu(self, x: Tensor, mm: ExpertMatmul) -> Tensor:
        """``W2_e (silu(W1_e x) * W3_e x)`` of rows ``x`` ``[..., H]`` with ``mm`` the per-expert
        product: one ``mm`` for gate and up where ``gate_up`` is one tensor, then one for down."""
        gate_up = self.gate_up
        if gate_up is not None:
            h = mm(x, gate_up.transpose(1, 2))
            inter = self.w1.shape[1]
            gate, up = h[..., :inter], h[..., inter:]
        else:
            gate, up = mm(x, self.w1.transpose(1, 2)), mm(x, self.w3.transpose(1, 2))
        return mm(swiglu(gate, up), self.w2.transpose(1, 2))


def grouped_mm_runs(hidden_states: Tensor, weights: ExpertWeights) -> bool:
    """Whether ``grouped_experts`` runs for these operands: one dtype, ``_grouped_mm`` available
    without a host read there, and row strides (H and F elements) multiples of 16 bytes."""
    dtype = hidden_states.dtype
    inter, hidden = weights.w1.shape[1:]
    aligned = (hidden * dtype.itemsize) % 16 == 0 and (inter * dtype.itemsize) % 16 == 0
    return (
        aligned
        and weights.w1.dtype == dtype
        and grouped_mm_unavailable(hidden_states.device, dtype) is None
    )


def dense_fits(num_tokens: int, weights: ExpertWeights) -> bool:
    """Whether ``dense_experts``' ``[E, N, max(2F, H)]`` intermediate fits DENSE_MAX_ELEMENTS."""
    num_experts, inter, hidden = weights.w1.shape
    return num_experts * num_tokens * max(2 * inter, hidden) <= DENSE_MAX_ELEMENTS


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertGroups:
    """The (row, slot) pairs of a ``Standard`` batch grouped by local expert, on the device."""

    order: Tensor  # [P] int64 flat pair index (row * K + slot) at each grouped position
    token_idx: Tensor  # [P] int64 row of each grouped position
    offsets: Tensor  # [E] int32 end of each expert's group (cumulative counts; _grouped_mm's offs)
    # [P] bool, False for slots of no local expert (grouped last, past offsets[-1])
    is_local: Tensor


def expert_keys(topk_ids: Tensor, num_experts: int) -> Tensor:
    """``[P]`` int64 sort key of each pair of ``topk_ids`` ``[N, K]``: its local expert id, or
    ``num_experts`` for an id outside ``[0, num_experts)`` (no local expert), in two ops: a
    clamp to ``[-1, E]``, then -1 -> E modulo E + 1."""
    return topk_ids.reshape(-1).clamp(-1, num_experts).remainder_(num_experts + 1)


def group_by_expert(topk_ids: Tensor, num_experts: int) -> ExpertGroups:
    """Group the pairs of ``topk_ids`` ``[N, K]`` (int64 local ids; -1, or any id outside
    ``[0, num_experts)``, is no local expert) by expert, on their device, with no host read:
    a stable sort keeps each expert's pairs in (row, slot) order, as the reference's loop."""
    sorted_ids, order = torch.sort(expert_keys(topk_ids, num_experts), stable=True)
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return ExpertGroups(
        order=order,
        token_idx=order // topk_ids.shape[1],
        offsets=offsets,
        is_local=sorted_ids < num_experts,
    )


def weighted_sum(y_pairs: Tensor, topk_weights: Tensor) -> Tensor:
    """``out[n] = sum_k topk_weights[n, k] * y_pairs[n, k]``: ``[N, K, H]`` -> ``[N, H]`` in
    y_pairs' dtype (the weights cast to it first, as the reference), one ``bmm``."""
    weights = topk_weights.to(y_pairs.dtype).unsqueeze(1)
    return torch.bmm(weights, y_pairs).squeeze(1)


def grouped_experts(
    hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights
) -> Tensor:
    """Σ_k topk_weights[n, k] · SwiGLU_expert(topk_ids[n, k])(hidden_states[n]) through
    ``torch._grouped_mm`` (module docstring), with no host read.

    Args:
        hidden_states: ``[N, H]`` in the weights' dtype (``grouped_mm_runs``), N >= 0.
        topk_ids: ``[N, K]`` int64 local ids, K >= 1; ids outside ``[0, E)`` add nothing.
        topk_weights: ``[N, K]`` any float dtype (cast to hidden_states' dtype).

    Returns:
        ``[N, H]`` in hidden_states' dtype.
    """
    num_tokens, num_topk = topk_ids.shape
    groups = group_by_expert(topk_ids, weights.w1.shape[0])
    x = hidden_states.index_select(0, groups.token_idx)  # [P, H], a row memcpy
    y = weights.swiglu(x, functools.partial(torch._grouped_mm, offs=groups.offsets))
    y = torch.where(groups.is_local[:, None], y, 0)  # rows past offsets[-1]: unspecified
    y_pairs = torch.empty_like(y).index_copy_(0, groups.order, y)
    return weighted_sum(y_pairs.view(num_tokens, num_topk, -1), topk_weights)


def dense_experts(
    hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights
) -> Tensor:
    """``grouped_experts``' result for any dtype: every row through every expert (one batched
    GEMM per projection, ``[E, N, H]``), then each slot takes its expert's row. Arguments as
    ``grouped_experts``; check ``dense_fits`` first."""
    num_experts = weights.w1.shape[0]
    y = weights.swiglu(hidden_states, torch.matmul)  # [E, N, H]
    is_local = (topk_ids >= 0) & (topk_ids < num_experts)
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
    y_pairs = y[topk_ids.clamp(0, num_experts - 1), rows]  # [N, K, H]
    y_pairs = torch.where(is_local[..., None], y_pairs, 0)
    return weighted_sum(y_pairs, topk_weights)


def batched_experts(
    hidden_states: Tensor, expert_num_tokens: Tensor, weights: ExpertWeights
) -> Tensor:
    """``TorchExperts.apply_batched`` with no host read: one batched GEMM per projection over
    all ``M`` rows of every expert, rows at or past ``expert_num_tokens[e]`` set to zero.

    Args:
        hidden_states: ``[E, M, H]`` in the weights' dtype; rows past a count may hold anything
            (NaN included: they are replaced, not multiplied).
        expert_num_tokens: ``[E]`` integer valid rows per expert, on hidden_states' device (a
            count above M means all M; not checked, since that would read it).

    Returns:
        ``[E, M, H]``: ``out[e, :n_e] = W2_e (silu(W1_e x) * W3_e x)``, the other rows zero.
    """
    y = weights.swiglu(hidden_states, torch.bmm)
    rows = torch.arange(hidden_states.shape[1], device=hidden_states.device)
    is_valid = rows[None, :] < expert_num_tokens[:, None]
    return torch.where(is_valid[..., None], y, 0)
