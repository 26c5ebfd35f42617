"""The MoE layer: ``[Router] -> [Prepare/Dispatch] -> [Experts] -> [Finalize/Combine]``.

``layer.FusedMoE`` owns the router and the experts' weights; ``modular_kernel`` runs the token flow
with the DBO yield points over a ``FusedMoEPrepareAndFinalize`` (``distributed.all2all``);
``experts`` computes.
"""

from moe.fused_moe.experts import TorchExperts
from moe.fused_moe.layer import FusedMoE
from moe.fused_moe.modular_kernel import FusedMoEModularKernel
from moe.fused_moe.router import Router, RoutingConfig, RoutingResult, select_experts

__all__ = [
    "FusedMoE",
    "FusedMoEModularKernel",
    "Router",
    "RoutingConfig",
    "RoutingResult",
    "TorchExperts",
    "select_experts",
]
