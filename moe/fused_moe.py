"""FusedMoE layer: router gate over all experts + this rank's experts + the modular kernel."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbo.timeline import timeline_span
from moe.experts import TorchExperts
from moe.modular_kernel import FusedMoEModularKernel, FusedMoEPrepareAndFinalize
from moe.router import select_experts


class FusedMoE(nn.Module):
    """Sparse MoE block (Mixtral ``block_sparse_moe``) holding only this rank's experts.

    Experts are assigned in contiguous blocks: EP rank r holds global experts
    ``[r * num_local_experts, (r + 1) * num_local_experts)``, ``num_local_experts = num_experts // ep_size``.

    Parameters: ``gate.weight`` [num_experts, hidden_size] (every rank routes over all experts),
    ``experts.w1``/``experts.w3`` [num_local_experts, intermediate_size, hidden_size],
    ``experts.w2`` [num_local_experts, hidden_size, intermediate_size].

    Raises:
        ValueError: num_experts not divisible by ep_size, ep_rank outside [0, ep_size), or a
            prepare_finalize that serves a different number of local experts.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        ep_rank: int = 0,
        ep_size: int = 1,
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size}), ep_size >= 1"
            )
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.top_k = top_k
        self.renormalize = renormalize
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = TorchExperts(
            num_local_experts=self.num_local_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            global_expert_offset=ep_rank * self.num_local_experts,
            dtype=dtype,
            device=device,
        )
        self.kernel = FusedMoEModularKernel(prepare_finalize, self.experts)

    @property
    def global_expert_ids(self) -> range:
        """Global ids of the experts this rank holds."""
        start = self.experts.global_expert_offset
        return range(start, start + self.num_local_experts)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states: [num_tokens, hidden_size] -> [num_tokens, hidden_size] (same dtype)."""
        with timeline_span("router"):
            router_logits = self.gate(hidden_states)
            routing = select_experts(router_logits, self.top_k, renormalize=self.renormalize)
        return self.kernel.forward(hidden_states, routing.topk_weights, routing.topk_ids)
