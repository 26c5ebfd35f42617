"""The experts on the CPU (``TorchExperts.forward_cpu`` / ``apply_batched_cpu``): the weights packed
once after loading (``pack_cpu_experts``), the measured cut of our compiled kernel, and the paths,
first that serves: the kernel, per-expert oneDNN packs, one grouped GEMM per projection with host
counts (``forward_grouped``), the reference. Paths, pack layouts, cuts: docs/hardware.md#experts.

Legend: N = rows, K = num_topk, E = num_local_experts, H = hidden_size, F = intermediate_size
(of one expert), P = (row, slot) pairs routed to this rank."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.fused_moe.grouped_experts import grouped_mm_runs
from moe.kernels.host import host_kernels
from moe.kernels.tuning import MEASURE_MAX_MACS, best_seconds, measure_max_rows, tuned_max_rows
from moe.layers import linear
from moe.layers.linear import (
    PackedWeights,
    can_pack,
    can_upcast,
    onednn_linear,
    onednn_pack,
    serves_packed,
    upcast_linear,
    upcast_wins,
)
from moe.platforms.custom_op import is_tracing

if TYPE_CHECKING:
    from moe.fused_moe.experts import TorchExperts

PACK_BLOCK = 16  # output columns per packed block (the kernel's kBlock)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# kernel builds that multiply bfloat16 weights in pairs of k (vdpbf16ps)
K_PAIR_ISAS = frozenset({"avx512_bf16"})


def fused_moe_kernels(
    hidden_size: int, intermediate_size: int, weight: Tensor
) -> ModuleType | None:
    """The compiled kernel module for experts of this shape with ``weight``'s dtype and device, or
    None where it does not apply: not on the host, a dtype other than float32 / bfloat16, H or 2F
    not a multiple of ``PACK_BLOCK``, a trace running, or no kernel build for this CPU (or
    ``MOE_DBO_CPU_KERNELS=0``)."""
    if (
        weight.dtype not in KERNEL_DTYPES
        or hidden_size % PACK_BLOCK
        or (2 * intermediate_size) % PACK_BLOCK
    ):
        return None
    return host_kernels(weight)


def k_group(kernels: ModuleType, dtype: torch.dtype) -> int:
    """How many k the ``kernels`` build packs together for weights of ``dtype``: 2 for bfloat16
    on a build of ``K_PAIR_ISAS``, else 1."""
    return 2 if dtype == torch.bfloat16 and kernels.isa() in K_PAIR_ISAS else 1


def pack_weights(weight: Tensor, kernels: ModuleType) -> Tensor:
    """``weight`` ``[E, cols, K]`` (cols a multiple of ``PACK_BLOCK``) as the ``kernels`` build
    reads it (a copy): ``[E, cols / 16, K, 16]``, element ``[e, c // 16, k, c % 16] =
    weight[e, c, k]``; with ``k_group`` 2, ``[E, cols / 16, K / 2, 16, 2]``, element
    ``[e, c // 16, k // 2, c % 16, k % 2]`` (K even)."""
    num_experts, cols, k = weight.shape
    group = k_group(kernels, weight.dtype)
    blocks = weight.detach().reshape(num_experts, cols // PACK_BLOCK, PACK_BLOCK, k // group, group)
    packed = blocks.permute(0, 1, 3, 2, 4).contiguous()
    return packed if group == 2 else packed.squeeze(4)


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuExpertPacks:
    """What ``pack_cpu_experts`` made, valid while the weights are the ones it read
    (``weights.is_current``; ``weights.packed``: the oneDNN packs ``(gate_up_0, down_0,
    gate_up_1, ...)``, empty where the grouped GEMMs run instead)."""

    weights: PackedWeights
    kernel: tuple[Tensor, ...] = ()  # (w13, w2) packed for the compiled kernel, or ()
    upcast: tuple[Tensor, ...] = ()  # float32 copies of small bfloat16 [w1_e; w3_e] and w2_e
    # rows per active expert up to which the compiled kernel serves (measured: tuned_max_rows)
    kernel_max_rows: float = math.inf

    def is_current(self, experts: TorchExperts) -> bool:
        return self.weights.is_current((experts.w1, experts.w2, experts.w3))

    def onednn(self, experts: TorchExperts) -> tuple[Tensor, ...]:
        """The oneDNN packs where a forward may use them now (``serves_packed``), else ()."""
        per_expert = experts.hidden_size * experts.intermediate_size
        if not all(
            serves_packed(w, num_elements=per_expert) for w in (experts.w1, experts.w2, experts.w3)
        ):
            return ()
        return self.weights.packed if self.is_current(experts) else ()


def pack_cpu_experts(experts: TorchExperts) -> CpuExpertPacks:
    """Pack ``experts``' weights (w1 and w3 already one allocation) for the compiled kernel where
    it serves this shape (float32 then needs nothing else: past the kernel's cut the grouped GEMMs
    run), else (and for bfloat16 also) prepack every local expert's ``[w1_e; w3_e]`` and ``w2_e``
    for oneDNN where it can, and keep float32 copies of small bfloat16 experts (``can_upcast``:
    plain torch, so kept where oneDNN cannot pack too); with the kernel, then look up (or measure)
    up to how many rows it beats those paths (``tuned_max_rows``)."""
    sources = (experts.w1, experts.w2, experts.w3)
    kernels = None if experts.w1.is_meta else _kernels(experts)
    if kernels is None:
        return _pack_per_expert(experts)
    w13 = experts.expert_weights().gate_up  # one view: packed, not copied
    kernel = (pack_weights(w13, kernels), pack_weights(experts.w2, kernels))
    if experts.w1.dtype == torch.float32:  # no second copy: the grouped GEMMs past the cut
        packs = CpuExpertPacks(weights=PackedWeights.of(sources, ()), kernel=kernel)
    else:
        packs = replace(_pack_per_expert(experts), kernel=kernel)
    case = f"experts {experts.w1.dtype} H={experts.hidden_size} F={experts.intermediate_size}"
    max_rows = tuned_max_rows(
        kernels, case, functools.partial(_measure_kernel_max_rows, experts, kernels, packs)
    )
    return replace(packs, kernel_max_rows=max_rows)


def _pack_per_expert(experts: TorchExperts) -> CpuExpertPacks:
    """The oneDNN packs and float32 copies of ``pack_cpu_experts``."""
    sources = (experts.w1, experts.w2, experts.w3)
    per_expert = experts.hidden_size * experts.intermediate_size
    if not all(can_pack(w, num_elements=per_expert) for w in sources):
        return CpuExpertPacks(weights=PackedWeights.of(sources, ()))
    packed: list[Tensor] | None = []  # None once oneDNN could not pack
    upcast: list[Tensor] = []
    for expert in range(experts.num_local_experts):  # start-up only
        w13 = torch.cat([experts.w1[expert], experts.w3[expert]]).detach()
        if can_upcast(w13):
            upcast += [w13.float(), experts.w2[expert].detach().float()]
        if packed is None:
            continue
        gate_up, down = onednn_pack(w13), onednn_pack(experts.w2[expert])
        packed = None if gate_up is None or down is None else [*packed, gate_up, down]
    return CpuExpertPacks(
        weights=PackedWeights.of(sources, tuple(packed or ())), upcast=tuple(upcast)
    )


@torch.no_grad()
def _measure_kernel_max_rows(
    experts: TorchExperts, kernels: ModuleType, packs: CpuExpertPacks
) -> float:
    """``measure_max_rows`` on these experts: the kernel against the torch paths
    (``_torch_paths``) on rows all routed to expert 0, up to ``MEASURE_MAX_MACS`` multiply-adds a
    call (rows from a generator of its own, so the global RNG is left as it was)."""
    gen = torch.Generator().manual_seed(0)

    def seconds(kernel: bool, rows: int) -> float:
        x = torch.randn(rows, experts.hidden_size, generator=gen).to(experts.w1.dtype)
        ids, weights = torch.zeros(rows, 1, dtype=torch.int64), torch.ones(rows, 1)
        if kernel:
            return best_seconds(lambda: _kernel_call(kernels, packs.kernel, x, ids, weights))
        return best_seconds(lambda: _torch_paths(experts, packs, x, ids, weights))

    expert_elements = 3 * experts.hidden_size * experts.intermediate_size
    return measure_max_rows(seconds, MEASURE_MAX_MACS // expert_elements)


def _kernels(experts: TorchExperts) -> ModuleType | None:
    return fused_moe_kernels(experts.hidden_size, experts.intermediate_size, experts.w1)


def serving_kernel(
    experts: TorchExperts, packs: CpuExpertPacks | None, x: Tensor, rows_per_expert: float
) -> ModuleType | None:
    """The compiled kernel module where it serves rows ``x`` with ``rows_per_expert`` rows per
    active expert on average now: packs current, the activation in the weights' dtype, at most
    the measured cut, no autograd through it, no trace; else None."""
    if packs is None or not packs.kernel or rows_per_expert > packs.kernel_max_rows:
        return None
    sources = (experts.w1, experts.w2, experts.w3)
    if x.dtype != experts.w1.dtype or (
        torch.is_grad_enabled() and any(t.requires_grad for t in (x, *sources))
    ):
        return None
    kernels = _kernels(experts)  # None under a trace or with MOE_DBO_CPU_KERNELS=0
    return kernels if kernels is not None and packs.is_current(experts) else None


def _kernel_call(
    kernels: ModuleType, kernel_packs: tuple[Tensor, ...], x: Tensor, ids: Tensor, weights: Tensor
) -> Tensor:
    out = torch.empty_like(x)
    kernels.fused_moe(
        out,
        x.contiguous(),
        *kernel_packs,
        ids.to(torch.int64).contiguous(),
        weights.to(torch.float32).contiguous(),
    )
    return out


def forward_cpu(
    experts: TorchExperts,
    packs: CpuExpertPacks | None,
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
) -> Tensor:
    """``TorchExperts.forward_cpu`` (module docstring: the kernel where it serves, which checks
    the operands' shapes itself, else ``_torch_paths``); ``packs`` None: nothing was packed."""
    num_pairs = topk_ids.numel()
    rows_per_expert = num_pairs / max(1, min(num_pairs, experts.num_local_experts))
    kernels = serving_kernel(experts, packs, hidden_states, rows_per_expert)
    if kernels is not None:
        return _kernel_call(kernels, packs.kernel, hidden_states, topk_ids, topk_weights)
    return _torch_paths(experts, packs, hidden_states, topk_ids, topk_weights)


def _torch_paths(
    experts: TorchExperts,
    packs: CpuExpertPacks | None,
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
) -> Tensor:
    """Per expert on the oneDNN packs or the float32 copies where there are any (and the
    activation has the weights' dtype), else ``forward_grouped``."""
    onednn, upcast = _per_expert_packs(experts, packs)
    if hidden_states.dtype == experts.w1.dtype and (onednn or upcast):
        swiglu_rows = functools.partial(_swiglu_rows, experts, onednn=onednn, upcast=upcast)
        return _per_expert(experts, hidden_states, topk_ids, topk_weights, swiglu_rows)
    return forward_grouped(experts, hidden_states, topk_ids, topk_weights)


def _per_expert_packs(
    experts: TorchExperts, packs: CpuExpertPacks | None
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """(oneDNN packs, float32 copies) a forward may use now: both empty where nothing was packed
    or the weights changed since; under a trace (parameters are then graph inputs, not the
    packed tensors) the copies taken at load."""
    if packs is None:
        return (), ()
    if is_tracing():
        return (), packs.upcast
    if not packs.is_current(experts):
        return (), ()
    return packs.onednn(experts), packs.upcast


def forward_grouped(
    experts: TorchExperts, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
) -> Tensor:
    """One grouped GEMM for gate and up, one for down, over the per-expert row groups with
    the counts on the host, local pairs only (``forward_native`` where ``grouped_mm_runs``
    says no: float64, unaligned row strides, no ``_grouped_mm``)."""
    weights = experts.expert_weights()
    if not grouped_mm_runs(hidden_states, weights):
        return experts.forward_native(hidden_states, topk_ids, topk_weights)
    out, routed = _routed_rows(experts, hidden_states, topk_ids)
    if routed is None:
        return out
    pairs, counts, token_idx, x = routed
    offsets = torch.tensor(counts[1:], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    y = weights.swiglu(x, functools.partial(torch._grouped_mm, offs=offsets))
    y = y * topk_weights.reshape(-1)[pairs, None].to(y.dtype)
    return out.index_add_(0, token_idx, y)


def _routed_rows(experts: TorchExperts, hidden_states: Tensor, topk_ids: Tensor):
    """The zero output ``[N, H]`` and, if any slot is local, (pairs sorted by expert, counts [-1
    first, then per expert], token row of each pair, the gathered rows ``[P, H]`` grouped by
    expert); None instead of the tuple when nothing is routed here. ValueError for a local id
    >= E."""
    out = torch.zeros_like(hidden_states)
    if topk_ids.numel() == 0:
        return out, None
    num_experts = experts.num_local_experts
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    # blocking host sync: group sizes drive the loop / grouped GEMM offsets
    counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    if len(counts) > num_experts + 1:
        raise ValueError(
            f"topk_ids holds local expert id {int(flat_ids.max())} >= "
            f"num_local_experts={num_experts}"
        )
    pairs = order[counts[0] :]  # drop slots routed to other ranks (id -1, sorted first)
    if pairs.numel() == 0:
        return out, None
    token_idx = pairs // topk_ids.shape[1]
    # index_select copies whole rows (memcpy); hidden_states[token_idx] takes the slower
    # generic indexing kernel (docs/hardware.md#experts)
    return out, (pairs, counts, token_idx, hidden_states.index_select(0, token_idx))


def _per_expert(
    experts: TorchExperts,
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    swiglu_rows: Callable[[Tensor, int], Tensor],
) -> Tensor:
    """Per local expert: ``swiglu_rows(rows [n, H], expert)`` (unweighted ``[n, H]``), its
    top-k weights in place and a scatter-add (``index_add_``) into the token rows. The same
    arithmetic as one weighting and one scatter-add over all experts' rows after a
    ``torch.cat`` (pairs are added in the same order), without the cat's copy and the
    temporaries (bit-identical)."""
    out, routed = _routed_rows(experts, hidden_states, topk_ids)
    if routed is None:
        return out
    pairs, counts, token_idx, x = routed
    weights = topk_weights.reshape(-1)[pairs, None].to(x.dtype)
    start = 0
    for expert, count in enumerate(counts[1:]):  # a loop over experts, not over tokens
        if count == 0:
            continue
        end = start + count
        y = swiglu_rows(x[start:end], expert).mul_(weights[start:end])
        out.index_add_(0, token_idx[start:end], y)
        start = end
    return out


def _swiglu_rows(
    experts: TorchExperts,
    rows: Tensor,
    expert: int,
    *,
    onednn: tuple[Tensor, ...],
    upcast: tuple[Tensor, ...],
) -> Tensor:
    """``W2_e (silu(W1_e x) * W3_e x)`` of ``rows`` ``[n, H]`` -> ``[n, H]`` (unweighted) for
    local expert ``expert``: one packed GEMM for gate and up, SwiGLU in place, one packed GEMM
    for down; a float32 expert with more than ``float32_max_packed_rows()`` rows runs the
    reference's plain GEMMs instead (MKL's sgemm is faster there, as for ``Linear``)."""
    if rows.dtype == torch.float32 and rows.shape[0] > linear.float32_max_packed_rows():
        return experts.expert_swiglu(rows, expert)
    inter = experts.intermediate_size
    gate_up = _packed_gemm(experts, rows, 2 * expert, onednn, upcast)  # [n, 2F]
    h = F.silu(gate_up[:, :inter])  # swiglu, with the product in place
    h.mul_(gate_up[:, inter:])
    return _packed_gemm(experts, h, 2 * expert + 1, onednn, upcast)


def _packed_gemm(
    experts: TorchExperts,
    x: Tensor,
    index: int,
    onednn: tuple[Tensor, ...],
    upcast: tuple[Tensor, ...],
) -> Tensor:
    """``x @ W.T`` for pack ``index`` (``[w1_e; w3_e]`` or ``w2_e``): in float32 on the
    weight's float32 copy where that is faster (``upcast_wins``), else the oneDNN pack, else
    (no pack: a CPU oneDNN cannot pack bfloat16 for) the plain weights."""
    if upcast and upcast_wins(x, upcast[index].numel()):
        return upcast_linear(x, upcast[index])
    if onednn:
        return onednn_linear(x, onednn[index])
    expert = index // 2
    if index % 2:
        return x @ experts.w2[expert].t()
    return torch.cat([x @ experts.w1[expert].t(), x @ experts.w3[expert].t()], dim=1)


def apply_batched_cpu(
    experts: TorchExperts, packs: CpuExpertPacks | None, hidden_states: Tensor, counts: list[int]
) -> Tensor:
    """``TorchExperts.apply_batched`` with host counts (checked): the kernel's batched entry
    where it serves, else per expert on the oneDNN packs or float32 copies, else the
    reference's plain GEMMs (``TorchExperts.batched_per_expert``)."""
    if hidden_states.dtype != experts.w1.dtype:
        return experts.batched_per_expert(hidden_states, counts, experts.expert_swiglu)
    active = sum(1 for count in counts if count)
    kernels = serving_kernel(experts, packs, hidden_states, sum(counts) / max(1, active))
    if kernels is not None:
        out = torch.empty_like(hidden_states)
        kernels.fused_moe_batched(out, hidden_states.contiguous(), *packs.kernel, counts)
        return out
    onednn, upcast = _per_expert_packs(experts, packs)
    swiglu_rows = experts.expert_swiglu
    if onednn or upcast:
        swiglu_rows = functools.partial(_swiglu_rows, experts, onednn=onednn, upcast=upcast)
    return experts.batched_per_expert(hidden_states, counts, swiglu_rows)
