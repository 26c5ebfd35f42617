"""The experts' computation (the "Permute-Experts-Unpermute" stage of the modular kernel).

Legend: N = rows (tokens received by this rank), K = num_topk, E = num_local_experts,
H = hidden_size, F = intermediate_size (of one expert), P = (row, slot) pairs routed to this rank.

One entry point per activation format (``TorchExperts.activation_formats``): ``apply_standard``
takes received rows with their LOCAL top-k ids and weights and returns weighted sums, through the
``CustomOp`` implementation bound to ``forward``; ``apply_batched`` takes the ``[E, M, H]`` layout
of DeepEP's low-latency dispatch (vLLM's batched experts) and returns UNWEIGHTED outputs.
Implementations: ``forward_native``, the reference loop over the local experts; ``forward_cpu``,
our compiled kernel for all experts in one call where it serves (``moe.fused_moe.cpu_fused``),
else per expert prepacked oneDNN GEMMs (``moe.layers.linear``; gate and up as one on
``[w1_e; w3_e]``), else grouped GEMMs (``torch._grouped_mm``), else the reference;
``forward_cuda``, nothing read to the host (``moe.fused_moe.grouped_experts``). Choices and
measurements: docs/hardware.md#experts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed import FusedMoEActivationFormat
from moe.fused_moe.cpu_fused import fused_moe_kernels, pack_weights
from moe.fused_moe.grouped_experts import (
    ExpertWeights,
    batched_experts,
    dense_experts,
    dense_fits,
    grouped_experts,
    grouped_mm_runs,
    grouped_mm_unavailable,
)
from moe.kernels.tuning import MEASURE_MAX_MACS, best_seconds, measure_max_rows, tuned_max_rows
from moe.layers import linear
from moe.layers.activation import swiglu
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
from moe.platforms.custom_op import CustomOp

# Mixtral's checkpoint names the three matrices w1 (gate), w2 (down), w3 (up); DeepSeek, Qwen and
# OLMoE name them gate_proj / down_proj / up_proj.
MIXTRAL_EXPERT_NAMES = {"w1": "w1", "w2": "w2", "w3": "w3"}
GATE_UP_DOWN_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


@CustomOp.register("experts")
class TorchExperts(CustomOp):
    """The experts one EP rank owns, stacked on dim 0: local id l holds global expert
    ``global_expert_offset + l`` (= ``ep_rank * E + l``).

    Parameters: w1 (gate) and w3 (up) ``[E, F, H]``, the two halves of one ``[E, 2F, H]``
    allocation (``expert_weights().gate_up``), w2 (down) ``[E, H, F]``; ``checkpoint_names`` maps
    them to the checkpoint's per-expert tensor names (``experts.{e}.<name>.weight``).
    """

    # the activation formats these experts take (``FusedMoEModularKernel`` checks the
    # prepare/finalize's against them): ``apply_standard`` and ``apply_batched``
    activation_formats: ClassVar[tuple[FusedMoEActivationFormat, ...]] = (
        FusedMoEActivationFormat.Standard,
        FusedMoEActivationFormat.BatchedExperts,
    )

    def __init__(
        self,
        *,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        global_expert_offset: int = 0,
        checkpoint_names: dict[str, str] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
        self.num_local_experts = num_local_experts
        self.global_expert_offset = global_expert_offset
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.checkpoint_names = dict(checkpoint_names or MIXTRAL_EXPERT_NAMES)
        kw = {"dtype": dtype, "device": device}
        # w1 and w3 in one allocation: [w1; w3] is then one GEMM operand without a copy
        w13 = torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, **kw)
        self.w1 = nn.Parameter(w13[:, :intermediate_size])
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size, **kw))
        self.w3 = nn.Parameter(w13[:, intermediate_size:])
        self._packs: PackedWeights | None = None
        # [w1; w3] and w2 packed for the compiled kernel (moe.fused_moe.cpu_fused), if it serves
        self._kernel_packs: PackedWeights | None = None
        # rows per active expert up to which the compiled kernel serves (measured: tuned_max_rows)
        self._kernel_max_rows = math.inf
        # float32 copies of small bfloat16 experts' [w1_e; w3_e] and w2_e (upcast_linear)
        self._upcast: tuple[Tensor, ...] = ()

    def process_weights_after_loading(self) -> None:
        """Pack the weights for the compiled kernel where it serves this shape
        (``moe.fused_moe.cpu_fused``; float32 then needs nothing else: past the kernel's cut the
        grouped GEMMs run), else prepack every local expert's ``[w1_e; w3_e]`` and ``w2_e`` for
        oneDNN (bfloat16 or float32 on the CPU; otherwise, or where oneDNN cannot, drop any pack:
        grouped GEMM), and keep float32 copies of small bfloat16 experts (``upcast_linear``: plain
        torch, so they are kept where oneDNN cannot pack too); with the kernel, then look up (or
        measure) up to how many rows it beats those paths (``tuned_max_rows``). First puts w1
        and w3 back into one allocation if something (``module.to``, ``.double()``) split them;
        probes ``torch._grouped_mm`` for ``forward_cuda`` on the weights' device (never inside a
        trace or a capture)."""
        self._packs, self._upcast, self._kernel_packs = None, (), None
        self._join_gate_up()
        if not self.w1.is_meta:  # probe now, not in a traced or captured forward
            grouped_mm_unavailable(self.w1.device, self.w1.dtype)
        kernels = None if self.w1.is_meta else self._kernels()
        sources = (self.w1, self.w2, self.w3)
        if kernels is None:
            self._pack_per_expert()
            return
        w13 = self.expert_weights().gate_up  # one view after _join_gate_up: packed, not copied
        self._kernel_packs = PackedWeights.of(
            sources, (pack_weights(w13, kernels), pack_weights(self.w2, kernels))
        )
        if self.w1.dtype == torch.float32:  # no second copy: the grouped GEMMs past the cut
            self._packs = PackedWeights.of(sources, ())
        else:
            self._pack_per_expert()
        case = f"experts {self.w1.dtype} H={self.hidden_size} F={self.intermediate_size}"
        self._kernel_max_rows = tuned_max_rows(kernels, case, self._measure_kernel_max_rows)

    def _pack_per_expert(self) -> None:
        """The oneDNN packs and float32 copies of ``process_weights_after_loading``."""
        sources = (self.w1, self.w2, self.w3)
        per_expert = self.hidden_size * self.intermediate_size
        if not all(can_pack(w, num_elements=per_expert) for w in sources):
            return
        packed: list[Tensor] | None = []  # None once oneDNN could not pack
        upcast: list[Tensor] = []
        for expert in range(self.num_local_experts):  # start-up only
            w13 = torch.cat([self.w1[expert], self.w3[expert]]).detach()
            if can_upcast(w13):
                upcast += [w13.float(), self.w2[expert].detach().float()]
            if packed is None:
                continue
            gate_up, down = onednn_pack(w13), onednn_pack(self.w2[expert])
            packed = None if gate_up is None or down is None else [*packed, gate_up, down]
        self._packs = PackedWeights.of(sources, tuple(packed or ()))
        self._upcast = tuple(upcast)

    @torch.no_grad()
    def _measure_kernel_max_rows(self) -> float:
        """``measure_max_rows`` on these experts: ``forward_cpu`` on expert 0 with the kernel
        forced on, then off, up to ``MEASURE_MAX_MACS`` multiply-adds a call (the packs are made;
        only the times matter; rows from a generator of its own, so the global RNG is left as it
        was)."""
        gen = torch.Generator().manual_seed(0)

        def seconds(kernel: bool, rows: int) -> float:
            x = torch.randn(rows, self.hidden_size, generator=gen).to(self.w1.dtype)
            ids, weights = torch.zeros(rows, 1, dtype=torch.int64), torch.ones(rows, 1)
            self._kernel_max_rows = math.inf if kernel else -1.0
            return best_seconds(lambda: self.forward_cpu(x, ids, weights))

        expert_elements = 3 * self.hidden_size * self.intermediate_size
        return measure_max_rows(seconds, MEASURE_MAX_MACS // expert_elements)

    @torch.no_grad()
    def _join_gate_up(self) -> None:
        if self.w1.is_meta or self.expert_weights().gate_up is not None:
            return
        w13 = torch.cat([self.w1, self.w3], dim=1)  # once, at load
        inter = self.intermediate_size
        self.w1.data, self.w3.data = w13[:, :inter], w13[:, inter:]

    def _kernels(self):
        """The compiled kernel module if it serves these experts (``fused_moe_kernels``)."""
        return fused_moe_kernels(self.hidden_size, self.intermediate_size, self.w1)

    def kernel_packed_weights(self, x: Tensor, rows_per_expert: float) -> tuple[Tensor, ...]:
        """``(w13, w2)`` packed for the compiled kernel (re-made if a weight changed) where it
        serves rows ``x`` with ``rows_per_expert`` rows per active expert on average
        (the dtype, the shape, the measured cut, no autograd through it), else empty."""
        serving = self._serving_kernel(x, rows_per_expert)
        return () if serving is None else serving[1]

    def _serving_kernel(self, x: Tensor, rows_per_expert: float):
        """(the compiled kernel module, its packs) where ``kernel_packed_weights`` has packs,
        else None: one module lookup for the decision and the call."""
        sources = (self.w1, self.w2, self.w3)
        if x.dtype != self.w1.dtype or (
            torch.is_grad_enabled() and any(t.requires_grad for t in (x, *sources))
        ):
            return None
        kernels = self._kernels()
        if kernels is None or rows_per_expert > self._kernel_max_rows:
            return None
        if self._kernel_packs is None or not self._kernel_packs.is_current(sources):
            self.process_weights_after_loading()
        if self._kernel_packs is None or not self._kernel_packs.packed:
            return None
        return kernels, self._kernel_packs.packed

    def expert_weights(self) -> ExpertWeights:
        """The weights as the device paths take them (``[w1; w3]`` as one view where it is one)."""
        return ExpertWeights(self.w1, self.w2, self.w3)

    def packed_weights(self) -> tuple[Tensor, ...]:
        """``(gate_up_0, down_0, gate_up_1, ...)`` prepacked for oneDNN, re-made if a weight
        changed; empty where the grouped GEMM runs instead."""
        sources = (self.w1, self.w2, self.w3)
        per_expert = self.hidden_size * self.intermediate_size
        if not all(serves_packed(w, num_elements=per_expert) for w in sources):
            return ()
        if self._packs is None or not self._packs.is_current(sources):
            self.process_weights_after_loading()
        return () if self._packs is None else self._packs.packed

    def apply_standard(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> Tensor:
        """The experts on the ``Standard`` activation format (``DispatchResult`` rows):
        Σ_k topk_weights[n, k] · SwiGLU_expert(topk_ids[n, k])(hidden_states[n]), through the
        implementation ``CustomOp`` bound to ``forward`` (``forward_cpu`` or ``forward_native``).

        Args:
            hidden_states: [N, H], dtype of the weights (N may be 0).
            topk_ids: [N, K] int64 LOCAL expert ids in [0, E); -1 = slot not on this rank (skipped).
            topk_weights: [N, K] float32 (any float is accepted; cast to the activation dtype).

        Returns:
            [N, H] in hidden_states' dtype, the WEIGHTED sums; rows with no local expert are zero.

        Raises:
            ValueError: shape mismatch or a local id >= E.
        """
        return self.forward(hidden_states, topk_ids, topk_weights)

    def _check(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [num_tokens, {self.hidden_size}], "
                f"got {tuple(hidden_states.shape)}"
            )
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != hidden_states.shape[:1]:
            raise ValueError(
                f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                f"must be [{hidden_states.shape[0]}, num_topk]"
            )

    def forward_native(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> Tensor:
        """The reference: one gather and three GEMMs per local expert, written apart from the
        fast paths so that it checks them."""
        self._check(hidden_states, topk_ids, topk_weights)
        flat_ids, flat_weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
        if flat_ids.numel() and int(flat_ids.max()) >= self.num_local_experts:
            raise ValueError(
                f"topk_ids holds local expert id {int(flat_ids.max())} >= "
                f"num_local_experts={self.num_local_experts}"
            )
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_local_experts):
            pairs = (flat_ids == expert).nonzero().squeeze(1)  # ascending, as a stable sort's
            token_idx = pairs // topk_ids.shape[1]
            x = hidden_states[token_idx]
            y = swiglu(x @ self.w1[expert].t(), x @ self.w3[expert].t()) @ self.w2[expert].t()
            out.index_add_(0, token_idx, y * flat_weights[pairs, None].to(y.dtype))
        return out

    def forward_cpu(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """Our compiled kernel for all experts at once where it serves (``_serving_kernel``),
        else prepacked oneDNN GEMMs per expert (bfloat16, float32) or one grouped GEMM per
        projection over the per-expert row groups (same math as ``forward_native``)."""
        self._check(hidden_states, topk_ids, topk_weights)
        num_pairs = topk_ids.numel()
        serving = self._serving_kernel(
            hidden_states, num_pairs / max(1, min(num_pairs, self.num_local_experts))
        )
        if serving is not None:
            kernels, packs = serving
            out = torch.empty_like(hidden_states)
            kernels.fused_moe(
                out,
                hidden_states.contiguous(),
                *packs,
                topk_ids.to(torch.int64).contiguous(),
                topk_weights.to(torch.float32).contiguous(),
            )
            return out
        packs = self.packed_weights()
        if hidden_states.dtype == self.w1.dtype and (packs or self._upcast):
            swiglu_rows = functools.partial(self._swiglu_rows, packs=packs)
            return self._per_expert(hidden_states, topk_ids, topk_weights, swiglu_rows)
        return self.forward_grouped(hidden_states, topk_ids, topk_weights)

    def forward_grouped(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> Tensor:
        """One grouped GEMM for gate and up, one for down, over the per-expert row groups with
        the counts on the host, local pairs only (``forward_native`` where ``grouped_mm_runs``
        says no: float64, unaligned row strides, no ``_grouped_mm``)."""
        weights = self.expert_weights()
        if not grouped_mm_runs(hidden_states, weights):
            return self.forward_native(hidden_states, topk_ids, topk_weights)
        out, routed = self._routed_rows(hidden_states, topk_ids, topk_weights)
        if routed is None:
            return out
        pairs, counts, token_idx, x = routed
        offsets = torch.tensor(counts[1:], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        y = weights.swiglu(x, functools.partial(torch._grouped_mm, offs=offsets))
        y = y * topk_weights.reshape(-1)[pairs, None].to(y.dtype)
        return out.index_add_(0, token_idx, y)

    def forward_cuda(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """``forward_native``'s result with nothing read to the host (CUDA-graph capturable):
        ``grouped_experts`` where ``grouped_mm_runs``, else ``dense_experts`` where it fits, else
        the reference. Pure torch, so it runs (and is tested) on CPU tensors too. Unlike the
        reference, a local id >= E is not refused (that would read the ids): it adds nothing.

        Raises:
            ValueError: shape mismatch.
        """
        self._check(hidden_states, topk_ids, topk_weights)
        if topk_ids.numel() == 0:
            return torch.zeros_like(hidden_states)
        weights = self.expert_weights()
        if grouped_mm_runs(hidden_states, weights):
            return grouped_experts(hidden_states, topk_ids, topk_weights, weights)
        if hidden_states.dtype == self.w1.dtype and dense_fits(hidden_states.shape[0], weights):
            return dense_experts(hidden_states, topk_ids, topk_weights, weights)
        return self.forward_native(hidden_states, topk_ids, topk_weights)

    def _routed_rows(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        """Checks, then the zero output ``[N, H]`` and, if any slot is local, (pairs sorted by
        expert, counts [-1 first, then per expert], token row of each pair, the gathered rows
        ``[P, H]`` grouped by expert); None instead of the tuple when nothing is routed here.
        ValueError for a local id >= E."""
        self._check(hidden_states, topk_ids, topk_weights)
        out = torch.zeros_like(hidden_states)
        if topk_ids.numel() == 0:
            return out, None
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        # blocking host sync: group sizes drive the loop / grouped GEMM offsets
        counts = torch.bincount(flat_ids + 1, minlength=self.num_local_experts + 1).tolist()
        if len(counts) > self.num_local_experts + 1:
            raise ValueError(
                f"topk_ids holds local expert id {int(flat_ids.max())} >= "
                f"num_local_experts={self.num_local_experts}"
            )
        pairs = order[counts[0] :]  # drop slots routed to other ranks (id -1, sorted first)
        if pairs.numel() == 0:
            return out, None
        token_idx = pairs // topk_ids.shape[1]
        # index_select copies whole rows (memcpy); hidden_states[token_idx] takes the slower
        # generic indexing kernel (docs/hardware.md#experts)
        return out, (pairs, counts, token_idx, hidden_states.index_select(0, token_idx))

    def _per_expert(
        self,
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
        out, routed = self._routed_rows(hidden_states, topk_ids, topk_weights)
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

    def _swiglu_rows(self, rows: Tensor, expert: int, *, packs: tuple[Tensor, ...]) -> Tensor:
        """``W2_e (silu(W1_e x) * W3_e x)`` of ``rows`` ``[n, H]`` -> ``[n, H]`` (unweighted) for
        local expert ``expert``: one packed GEMM for gate and up, SwiGLU in place, one packed GEMM
        for down; a float32 expert with more than ``float32_max_packed_rows()`` rows runs the
        reference's plain GEMMs instead (MKL's sgemm is faster there, as for ``Linear``)."""
        if rows.dtype == torch.float32 and rows.shape[0] > linear.float32_max_packed_rows():
            return self._plain_swiglu_rows(rows, expert)
        gate_up = self._packed_gemm(rows, packs, 2 * expert)  # [n, 2F]
        h = F.silu(gate_up[:, : self.intermediate_size])  # swiglu, with the product in place
        h.mul_(gate_up[:, self.intermediate_size :])
        return self._packed_gemm(h, packs, 2 * expert + 1)

    def _plain_swiglu_rows(self, rows: Tensor, expert: int) -> Tensor:
        """``_swiglu_rows`` on the plain weights (the reference's own GEMMs)."""
        h = F.silu(rows @ self.w1[expert].t())
        h.mul_(rows @ self.w3[expert].t())
        return h @ self.w2[expert].t()

    def _packed_gemm(self, x: Tensor, packs: tuple[Tensor, ...], index: int) -> Tensor:
        """``x @ W.T`` for pack ``index`` (``[w1_e; w3_e]`` or ``w2_e``): in float32 on the
        weight's float32 copy where that is faster (``upcast_wins``), else the oneDNN pack, else
        (no pack: a CPU oneDNN cannot pack bfloat16 for) the plain weights."""
        if self._upcast and upcast_wins(x, self._upcast[index].numel()):
            return upcast_linear(x, self._upcast[index])
        if packs:
            return onednn_linear(x, packs[index])
        expert = index // 2
        if index % 2:
            return x @ self.w2[expert].t()
        return torch.cat([x @ self.w1[expert].t(), x @ self.w3[expert].t()], dim=1)

    def apply_batched(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> Tensor:
        """The experts on the ``BatchedExperts`` activation format (``BatchedDispatchResult``):
        SwiGLU of local expert l on its first ``expert_num_tokens[l]`` rows, UNWEIGHTED (the
        combine applies the top-k weights): per expert ``forward_cpu``'s GEMMs on the CPU path,
        ``batched_experts`` on the CUDA path (nothing read to the host, counts not checked), else
        (and for float64) the reference's plain GEMMs.

        Args:
            hidden_states: ``[E, M, H]`` (M = max_tokens_per_expert), dtype of the weights; rows
                past the count of their expert are ignored (DeepEP leaves them unspecified).
            expert_num_tokens: ``[E]`` integer valid rows per local expert, each in ``[0, M]``,
                on hidden_states' device.

        Returns:
            ``[E, M, H]`` in hidden_states' dtype: ``out[l, :n_l] = W2_l (silu(W1_l x) * W3_l x)``,
            rows past ``n_l`` zero.

        Raises:
            ValueError: on a shape mismatch, or (host paths) a count outside ``[0, M]``.
        """
        num_experts, max_tokens = self.num_local_experts, hidden_states.shape[1]
        if hidden_states.dim() != 3 or hidden_states.shape[::2] != (num_experts, self.hidden_size):
            raise ValueError(
                f"hidden_states must be [{num_experts}, max_tokens, {self.hidden_size}], got "
                f"{tuple(hidden_states.shape)}"
            )
        if expert_num_tokens.shape != (num_experts,):
            raise ValueError(
                f"expert_num_tokens must be [{num_experts}], got {tuple(expert_num_tokens.shape)}"
            )
        if self.forward_path == "forward_cuda" and hidden_states.dtype == self.w1.dtype:
            return batched_experts(hidden_states, expert_num_tokens, self.expert_weights())
        # blocking host sync: the per-expert row counts size the GEMMs
        counts = expert_num_tokens.tolist()
        if not all(0 <= n <= max_tokens for n in counts):
            raise ValueError(
                f"expert_num_tokens must hold {num_experts} counts in [0, {max_tokens}], "
                f"got {counts}"
            )
        return self._apply_batched_per_expert(hidden_states, counts)

    def _apply_batched_per_expert(self, hidden_states: Tensor, counts: list[int]) -> Tensor:
        """``apply_batched`` with host counts: per expert, the packed GEMMs on the CPU path, else
        the reference's plain GEMMs."""
        fast = self.forward_path == "forward_cpu" and hidden_states.dtype == self.w1.dtype
        if fast:
            active = sum(1 for count in counts if count)
            serving = self._serving_kernel(hidden_states, sum(counts) / max(1, active))
            if serving is not None:
                kernels, packs = serving
                out = torch.empty_like(hidden_states)
                kernels.fused_moe_batched(out, hidden_states.contiguous(), *packs, counts)
                return out
        packs = self.packed_weights() if fast else ()
        swiglu_rows = self._plain_swiglu_rows
        if fast and (packs or self._upcast):
            swiglu_rows = functools.partial(self._swiglu_rows, packs=packs)
        out = torch.empty_like(hidden_states)
        for expert, count in enumerate(counts):  # a loop over experts, not over tokens
            out[expert, count:].zero_()  # only the rows no expert output lands in
            if count:
                out[expert, :count] = swiglu_rows(hidden_states[expert, :count], expert)
        return out
