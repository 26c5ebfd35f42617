"""The experts' computation (the "Permute-Experts-Unpermute" stage of the modular kernel):
``TorchExperts``, one ``CustomOp`` with an entry point per activation format (``apply_standard``,
``apply_batched``) and its reference ``forward_native``, bound per platform to ``cpu_experts`` or
the device paths (``CudaExpertsBackend``). Entry points and paths:
docs/hardware.md#experts-entry-points-and-platforms.

Legend: N = rows (received by this rank), K = num_topk, E = num_local_experts, H = hidden_size,
F = intermediate_size (of one expert), P = (row, slot) pairs routed to this rank."""

from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from distributed import FusedMoEActivationFormat, debug_checks_enabled
from moe.fused_moe import cpu_experts, triton_experts
from moe.fused_moe.grouped_experts import (
    ExpertWeights,
    batched_experts,
    dense_experts,
    dense_fits,
    grouped_experts,
    grouped_mm_runs,
)
from moe.layers.activation import swiglu
from moe.platforms.custom_op import CustomOp
from moe.platforms.device_probes import grouped_mm_unavailable

CUDA_EXPERTS_ENV = "MOE_DBO_CUDA_EXPERTS"


class CudaExpertsBackend(enum.Enum):
    """What ``forward_cuda`` runs its grouped GEMMs with (``MOE_DBO_CUDA_EXPERTS``)."""

    GROUPED_MM = "grouped_mm"  # torch._grouped_mm (grouped_experts); the default
    TRITON = "triton"  # our Triton fused-MoE kernel (triton_experts)

    @classmethod
    def from_env(cls) -> CudaExpertsBackend:
        """``MOE_DBO_CUDA_EXPERTS`` (unset or empty: ``grouped_mm``), read when experts are built.

        Raises:
            ValueError: another value, or ``triton`` without the triton package.
        """
        value = os.environ.get(CUDA_EXPERTS_ENV, "").strip() or cls.GROUPED_MM.value
        try:
            backend = cls(value)
        except ValueError:
            names = [b.value for b in cls]
            raise ValueError(f"{CUDA_EXPERTS_ENV}={value!r} is not one of {names}") from None
        if backend is cls.TRITON and importlib.util.find_spec("triton") is None:
            raise ValueError(f"{CUDA_EXPERTS_ENV}=triton needs the triton package, not installed")
        return backend


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

    ``apply_standard`` and ``apply_batched`` check their arguments' shapes only with
    ``debug_checks`` (``MOE_DBO_DEBUG_CHECKS=1`` when built): the dispatch makes them.
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
        # what process_weights_cpu packed (None: nothing, the torch paths run)
        self.cpu_packs: cpu_experts.CpuExpertPacks | None = None
        self.cuda_backend = CudaExpertsBackend.from_env()
        self.debug_checks = debug_checks_enabled()
        self._process_weights = self.dispatch_method("process_weights")
        self._apply_batched = self.dispatch_method("apply_batched")

    def process_weights_after_loading(self) -> None:
        """The post-load hook (the loader calls it once the weights are in place; call it again
        after changing them): puts w1 and w3 back into one allocation if something
        (``module.to``, ``.double()``) split them, then the bound platform's preparation
        (``process_weights_cpu``: the CPU packs and the kernel's measured cut;
        ``process_weights_cuda``: the ``torch._grouped_mm`` probe, outside any capture). A
        forward never packs: packs of weights changed since are left unused."""
        self._join_gate_up()
        self._process_weights()

    def process_weights_native(self) -> None:
        """The reference needs nothing prepared."""

    def process_weights_cpu(self) -> None:
        self.cpu_packs = None if self.w1.is_meta else cpu_experts.pack_cpu_experts(self)

    def process_weights_cuda(self) -> None:
        if not self.w1.is_meta:  # probe now, not in a traced or captured forward
            grouped_mm_unavailable(self.w1.device, self.w1.dtype)

    @torch.no_grad()
    def _join_gate_up(self) -> None:
        if self.w1.is_meta or self.expert_weights().gate_up is not None:
            return
        w13 = torch.cat([self.w1, self.w3], dim=1)  # once, at load
        inter = self.intermediate_size
        self.w1.data, self.w3.data = w13[:, :inter], w13[:, inter:]

    def expert_weights(self) -> ExpertWeights:
        """The weights as the device paths take them (``[w1; w3]`` as one view where it is one)."""
        return ExpertWeights(self.w1, self.w2, self.w3)

    def packed_weights(self) -> tuple[Tensor, ...]:
        """``(gate_up_0, down_0, gate_up_1, ...)`` prepacked for oneDNN where a forward may use
        them now (``CpuExpertPacks.onednn``); empty where the grouped GEMM runs instead."""
        return () if self.cpu_packs is None else self.cpu_packs.onednn(self)

    def expert_swiglu(self, rows: Tensor, expert: int) -> Tensor:
        """``W2_e (silu(W1_e x) * W3_e x)`` of ``rows`` ``[n, H]`` -> ``[n, H]`` (unweighted) for
        local expert ``expert``: the reference's own GEMMs."""
        return swiglu(rows @ self.w1[expert].t(), rows @ self.w3[expert].t()) @ self.w2[expert].t()

    def apply_standard(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> Tensor:
        """The experts on the ``Standard`` activation format (``DispatchResult`` rows):
        Σ_k topk_weights[n, k] · SwiGLU_expert(topk_ids[n, k])(hidden_states[n]), through the
        implementation ``CustomOp`` bound to ``forward`` (``forward_cpu``, ``forward_cuda`` or
        ``forward_native``).

        Args:
            hidden_states: [N, H], dtype of the weights (N may be 0).
            topk_ids: [N, K] int64 LOCAL expert ids in [0, E); -1 = slot not on this rank (skipped).
            topk_weights: [N, K] float32 (any float is accepted; cast to the activation dtype).

        Returns:
            [N, H] in hidden_states' dtype, the WEIGHTED sums; rows with no local expert are zero.

        Raises:
            ValueError: with ``debug_checks``, a shape mismatch; on the reference, a local
                id >= E.
        """
        if self.debug_checks:
            self._check_standard(hidden_states, topk_ids, topk_weights)
        return self.forward(hidden_states, topk_ids, topk_weights)

    def _check_standard(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        """ValueError unless the rows are ``[N, H]`` and the top-k ids and weights ``[N, K]``."""
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
            y = self.expert_swiglu(hidden_states[token_idx], expert)
            out.index_add_(0, token_idx, y * flat_weights[pairs, None].to(y.dtype))
        return out

    def forward_cpu(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """``forward_native``'s sums through ``cpu_experts.forward_cpu``: our compiled kernel for
        all experts at once where it serves, else prepacked oneDNN GEMMs per expert (bfloat16,
        float32) or one grouped GEMM per projection over the per-expert row groups."""
        return cpu_experts.forward_cpu(self, self.cpu_packs, hidden_states, topk_ids, topk_weights)

    def forward_cuda(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """``forward_native``'s result with nothing read to the host (CUDA-graph capturable):
        the Triton kernel where chosen (``CudaExpertsBackend``) and it runs these operands, else
        ``grouped_experts`` where ``grouped_mm_runs``, else ``dense_experts`` where it fits, else
        the reference. Runs (and is tested) on CPU tensors too: the torch paths as they are, the
        Triton kernel under ``TRITON_INTERPRET=1``. Unlike the reference, a local id >= E is not
        refused (that would read the ids): it adds nothing.
        """
        if topk_ids.numel() == 0:
            return torch.zeros_like(hidden_states)
        weights = self.expert_weights()
        if self.cuda_backend is CudaExpertsBackend.TRITON and triton_experts.runs(
            hidden_states, weights
        ):
            return triton_experts.fused_experts(hidden_states, topk_ids, topk_weights, weights)
        if grouped_mm_runs(hidden_states, weights):
            return grouped_experts(hidden_states, topk_ids, topk_weights, weights)
        if hidden_states.dtype == self.w1.dtype and dense_fits(hidden_states.shape[0], weights):
            return dense_experts(hidden_states, topk_ids, topk_weights, weights)
        return self.forward_native(hidden_states, topk_ids, topk_weights)

    def apply_batched(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> Tensor:
        """The experts on the ``BatchedExperts`` activation format (``BatchedDispatchResult``):
        SwiGLU of local expert l on its first ``expert_num_tokens[l]`` rows, UNWEIGHTED (the
        combine applies the top-k weights), through the implementation bound for this platform:
        ``apply_batched_cpu`` (the CPU paths per expert, counts read to the host),
        ``apply_batched_cuda`` (``batched_experts``: nothing read to the host, counts not
        checked), else ``apply_batched_native`` (the reference's plain GEMMs per expert).

        Args:
            hidden_states: ``[E, M, H]`` (M = max_tokens_per_expert), dtype of the weights; rows
                past the count of their expert are ignored (DeepEP leaves them unspecified).
            expert_num_tokens: ``[E]`` integer valid rows per local expert, each in ``[0, M]``,
                on hidden_states' device.

        Returns:
            ``[E, M, H]`` in hidden_states' dtype: ``out[l, :n_l] = W2_l (silu(W1_l x) * W3_l x)``,
            rows past ``n_l`` zero.

        Raises:
            ValueError: with ``debug_checks``, a shape mismatch; (host paths) a count outside
                ``[0, M]``.
        """
        if self.debug_checks:
            self._check_batched(hidden_states, expert_num_tokens)
        return self._apply_batched(hidden_states, expert_num_tokens)

    def _check_batched(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> None:
        """ValueError unless the rows are ``[E, M, H]`` and the counts ``[E]``."""
        num_experts = self.num_local_experts
        if hidden_states.dim() != 3 or hidden_states.shape[::2] != (num_experts, self.hidden_size):
            raise ValueError(
                f"hidden_states must be [{num_experts}, max_tokens, {self.hidden_size}], got "
                f"{tuple(hidden_states.shape)}"
            )
        if expert_num_tokens.shape != (num_experts,):
            raise ValueError(
                f"expert_num_tokens must be [{num_experts}], got {tuple(expert_num_tokens.shape)}"
            )

    def apply_batched_native(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> Tensor:
        """``apply_batched``'s reference: per expert the reference's plain GEMMs."""
        counts = self._host_counts(hidden_states, expert_num_tokens)
        return self.batched_per_expert(hidden_states, counts, self.expert_swiglu)

    def apply_batched_cpu(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> Tensor:
        counts = self._host_counts(hidden_states, expert_num_tokens)
        return cpu_experts.apply_batched_cpu(self, self.cpu_packs, hidden_states, counts)

    def apply_batched_cuda(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> Tensor:
        if hidden_states.dtype == self.w1.dtype:
            return batched_experts(hidden_states, expert_num_tokens, self.expert_weights())
        return self.apply_batched_native(hidden_states, expert_num_tokens)

    def _host_counts(self, hidden_states: Tensor, expert_num_tokens: Tensor) -> list[int]:
        """``expert_num_tokens`` on the host, checked to lie in ``[0, M]`` (ValueError)."""
        max_tokens = hidden_states.shape[1]
        # blocking host sync: the per-expert row counts size the GEMMs
        counts = expert_num_tokens.tolist()
        if not all(0 <= n <= max_tokens for n in counts):
            raise ValueError(
                f"expert_num_tokens must hold {self.num_local_experts} counts in "
                f"[0, {max_tokens}], got {counts}"
            )
        return counts

    def batched_per_expert(
        self, hidden_states: Tensor, counts: list[int], swiglu_rows: Callable[[Tensor, int], Tensor]
    ) -> Tensor:
        """``[E, M, H]`` -> ``[E, M, H]``: ``swiglu_rows(rows [n, H], expert)`` on each expert's
        first ``counts[e]`` rows, the rows past them zero."""
        out = torch.empty_like(hidden_states)
        for expert, count in enumerate(counts):  # a loop over experts, not over tokens
            out[expert, count:].zero_()  # only the rows no expert output lands in
            if count:
                out[expert, :count] = swiglu_rows(hidden_states[expert, :count], expert)
        return out
