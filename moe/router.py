"""Top-k expert selection (Mixtral router).

Softmax over all experts in float32, top-k, then renormalise the k weights to sum to 1 — the same
order of operations as HF ``MixtralTopKRouter`` and vLLM ``fused_topk``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingResult:
    """Experts chosen for each token.

    topk_weights: [num_tokens, num_topk] float32
    topk_ids:     [num_tokens, num_topk] int64, GLOBAL expert ids in [0, num_experts)
    """

    topk_weights: Tensor
    topk_ids: Tensor

    def __post_init__(self) -> None:
        if self.topk_weights.shape != self.topk_ids.shape or self.topk_ids.dim() != 2:
            raise ValueError(
                f"topk_weights {tuple(self.topk_weights.shape)} and topk_ids "
                f"{tuple(self.topk_ids.shape)} must both be [num_tokens, num_topk]"
            )
        if self.topk_weights.dtype != torch.float32 or self.topk_ids.dtype != torch.int64:
            raise ValueError(
                f"expected float32 topk_weights and int64 topk_ids, got "
                f"{self.topk_weights.dtype} and {self.topk_ids.dtype}"
            )


def select_experts(router_logits: Tensor, top_k: int, *, renormalize: bool = True) -> RoutingResult:
    """Pick the ``top_k`` experts of each token.

    Args:
        router_logits: [num_tokens, num_experts], any float dtype (upcast to float32).
        top_k: experts per token, in [1, num_experts].
        renormalize: divide the k selected probabilities by their sum (Mixtral: True).

    Returns:
        RoutingResult with float32 weights and int64 global expert ids, ordered by descending weight.

    Raises:
        ValueError: router_logits not 2-D, or top_k outside [1, num_experts].
    """
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be [num_tokens, num_experts], got {tuple(router_logits.shape)}"
        )
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return RoutingResult(topk_weights=topk_weights, topk_ids=topk_ids.to(torch.int64))
