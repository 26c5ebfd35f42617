"""FusedMoE layer: router gate over all experts + this rank's experts + the modular kernel,
plus the optional shared experts, which run while the combine is in flight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbo.timeline.recorder import timeline_span
from distributed import FusedMoEPrepareAndFinalize
from moe.compilation.splitting import splitting_op
from moe.fused_moe.experts import MIXTRAL_EXPERT_NAMES, TorchExperts
from moe.fused_moe.modular_kernel import FusedMoEModularKernel
from moe.fused_moe.router import Router, RoutingConfig
from moe.layers.mlp import DenseMLP


class FusedMoE(nn.Module):
    """Sparse MoE block (Mixtral ``block_sparse_moe``, DeepSeek/Qwen/OLMoE ``mlp``) holding only
    this rank's routed experts: EP rank r holds global experts ``[r * E, (r + 1) * E)``, E =
    ``num_local_experts = num_experts // ep_size``.

    Parameters: ``gate`` (``Router``, over all experts), ``experts`` (``TorchExperts``: w1/w3
    ``[E, intermediate_size, hidden_size]``, w2 ``[E, hidden_size, intermediate_size]``); with
    ``shared_intermediate_size`` > 0 a dense SwiGLU MLP named ``shared_expert_name`` (replicated on
    every rank), and with ``has_shared_expert_gate`` Qwen2-MoE's ``shared_expert_gate`` [1,
    hidden_size] (the shared output is scaled by sigmoid(gate · x)).

    Raises:
        ValueError: ep_rank outside [0, ep_size), a routing config over another number of
            experts, or a prepare_finalize that serves a different number of local experts
            (num_experts not a multiple of ep_size: the prepare_finalize refuses it when built).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        routing: RoutingConfig,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        ep_rank: int = 0,
        ep_size: int = 1,
        fp32_router: bool = False,
        expert_checkpoint_names: dict[str, str] | None = None,
        shared_intermediate_size: int = 0,
        shared_expert_name: str = "shared_experts",
        has_shared_expert_gate: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
        if routing.num_experts != num_experts:
            raise ValueError(
                f"routing is over {routing.num_experts} experts but num_experts={num_experts}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        kw = {"dtype": dtype, "device": device}
        self.gate = Router(hidden_size, routing, fp32_logits=fp32_router, **kw)
        self.experts = TorchExperts(
            num_local_experts=self.num_local_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            global_expert_offset=ep_rank * self.num_local_experts,
            checkpoint_names=expert_checkpoint_names or MIXTRAL_EXPERT_NAMES,
            **kw,
        )
        self.shared_expert_name = shared_expert_name if shared_intermediate_size else None
        if shared_intermediate_size:
            setattr(self, shared_expert_name, DenseMLP(hidden_size, shared_intermediate_size, **kw))
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False, **kw) if has_shared_expert_gate else None
        )
        self.kernel = FusedMoEModularKernel(prepare_finalize, self.experts)

    def _shared_experts(self, hidden_states: Tensor) -> Tensor:
        out = getattr(self, self.shared_expert_name)(hidden_states)
        if self.shared_expert_gate is not None:
            out = F.sigmoid(self.shared_expert_gate(hidden_states)) * out
        return out

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states: [num_tokens, hidden_size] -> [num_tokens, hidden_size] (same dtype)."""
        with timeline_span("router"):
            routing = self.gate(hidden_states)
        return splitting_op(  # dispatch/combine and their DBO yields: never inside a graph
            self._experts,
            hidden_states,
            routing.topk_ids,
            routing.topk_weights,
            out_shape=(hidden_states.shape[1],),
            # without expert parallelism nothing moves and nothing yields: a graph may hold it
            capturable=not self.kernel.prepare_finalize.moves_tokens,
        )

    def _experts(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The modular kernel (dispatch -> experts -> combine) with the shared experts."""
        shared = self._shared_experts if self.shared_expert_name else None
        return self.kernel.forward(hidden_states, topk_ids, topk_weights, shared_experts=shared)
