"""Router: gate logits and top-k expert selection for every supported architecture
(``select_experts``, in float32: ``greedy``, ``group_limited_greedy``, ``noaux_tc``; renormalizing
and ``routed_scaling_factor``), as ``TopKSelect`` and the ``Router`` module. The methods and their
order of operations: docs/models.md#router-top-k-selection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.platforms.custom_op import CustomOp

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingResult:
    """Experts chosen for each token."""

    topk_ids: Tensor  # [num_tokens, num_topk] int64, GLOBAL expert ids in [0, num_experts)
    topk_weights: Tensor  # [num_tokens, num_topk] float32

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


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    """How a MoE layer picks its experts (see the module docstring).

    Raises:
        ValueError: unknown method/scoring, top_k outside [1, num_experts], groups that do not
            divide num_experts, topk_group outside [1, num_expert_group], or noaux_tc without
            sigmoid scoring.
    """

    num_experts: int
    top_k: int
    renormalize: bool = True
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_score_correction_bias: bool = False

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method {self.topk_method!r} not supported; use one of {TOPK_METHODS}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r} not supported; use one of {SCORING_FUNCS}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if self.topk_method != "greedy":
            if self.num_expert_group < 1 or self.num_experts % self.num_expert_group:
                raise ValueError(
                    f"n_group ({self.num_expert_group}) must be >= 1 and divide num_experts "
                    f"({self.num_experts})"
                )
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(
                    f"topk_group must be in [1, n_group={self.num_expert_group}], "
                    f"got {self.topk_group}"
                )
        if self.topk_method == "noaux_tc" and self.scoring_func != "sigmoid":
            raise ValueError("topk_method 'noaux_tc' needs scoring_func 'sigmoid'")


def _group_mask(choice: Tensor, config: RoutingConfig, group_score: str) -> Tensor:
    """[num_tokens, num_experts] bool: experts whose group is among the topk_group best."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, config.num_expert_group, -1)
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:  # sum of the top-2 (a group of one expert scores that expert)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)


def _top_k(
    scores: Tensor, config: RoutingConfig, e_score_correction_bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(topk_weights, topk_ids)`` of ``scores [num_tokens, num_experts]`` float32 by
    ``config.topk_method`` (see the module docstring)."""
    if config.topk_method == "greedy":
        return torch.topk(scores, config.top_k, dim=-1)
    if config.topk_method == "group_limited_greedy":
        masked = scores.masked_fill(~_group_mask(scores, config, "max"), 0.0)
        return torch.topk(masked, config.top_k, dim=-1)
    if e_score_correction_bias is None:  # noaux_tc
        raise ValueError("topk_method 'noaux_tc' needs e_score_correction_bias")
    choice = scores + e_score_correction_bias.float()[None, :]
    choice = choice.masked_fill(~_group_mask(choice, config, "top2_sum"), float("-inf"))
    topk_ids = torch.topk(choice, config.top_k, dim=-1).indices
    return scores.gather(1, topk_ids), topk_ids


def select_experts(
    router_logits: Tensor,
    top_k: int | None = None,
    *,
    renormalize: bool = True,
    config: RoutingConfig | None = None,
    e_score_correction_bias: Tensor | None = None,
) -> RoutingResult:
    """Pick the experts of each token.

    Args:
        router_logits: [num_tokens, num_experts], any float dtype (upcast to float32).
        top_k, renormalize: the plain softmax top-k (Mixtral) when ``config`` is None.
        config: full routing settings (overrides top_k / renormalize).
        e_score_correction_bias: [num_experts] (noaux_tc only), any float dtype.

    Returns:
        RoutingResult with float32 weights and int64 GLOBAL expert ids.

    Raises:
        ValueError: router_logits not 2-D, width != num_experts, bad top_k, or noaux_tc without
            a bias.
    """
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be [num_tokens, num_experts], got {tuple(router_logits.shape)}"
        )
    if config is None:
        if top_k is None:
            raise ValueError("give top_k or config")
        config = RoutingConfig(
            num_experts=router_logits.shape[1], top_k=top_k, renormalize=renormalize
        )
    if router_logits.shape[1] != config.num_experts:
        raise ValueError(
            f"router_logits has {router_logits.shape[1]} experts, config says {config.num_experts}"
        )
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if config.scoring_func == "softmax" else logits.sigmoid()
    topk_weights, topk_ids = _top_k(scores, config, e_score_correction_bias)
    if config.renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if config.scoring_func == "sigmoid":
            denominator = denominator + 1e-20
        topk_weights = topk_weights / denominator
    if config.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * config.routed_scaling_factor
    return RoutingResult(topk_ids=topk_ids.to(torch.int64), topk_weights=topk_weights)


@CustomOp.register("router_topk")
class TopKSelect(CustomOp):
    """The top-k step as a dispatchable op (router_logits [N, E] -> RoutingResult)."""

    def __init__(self, config: RoutingConfig):
        super().__init__()
        self.config = config

    def forward_native(
        self, router_logits: Tensor, e_score_correction_bias: Tensor | None = None
    ) -> RoutingResult:
        return select_experts(
            router_logits, config=self.config, e_score_correction_bias=e_score_correction_bias
        )


class Router(nn.Module):
    """The ``gate`` of a MoE layer: ``weight`` [num_experts, hidden_size] (+ DeepSeek-V3's
    ``e_score_correction_bias`` [num_experts]) and the top-k op.

    ``fp32_logits``: compute the logits in float32 whatever the model dtype (DeepSeek, as
    transformers' ``F.linear(x.float(), w.float())``); otherwise in the model dtype (Mixtral, Qwen).
    """

    def __init__(
        self,
        hidden_size: int,
        config: RoutingConfig,
        *,
        fp32_logits: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.config = config
        self.fp32_logits = fp32_logits
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, hidden_size, dtype=dtype, device=device)
        )
        if config.has_score_correction_bias:
            # float32 as in DeepSeek-V3's checkpoints; small values decide ties, keep precision
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.e_score_correction_bias = None
        self.topk = TopKSelect(config)

    def forward(self, hidden_states: Tensor) -> RoutingResult:
        """hidden_states [num_tokens, hidden_size] -> RoutingResult (global expert ids)."""
        if self.fp32_logits:
            logits = F.linear(hidden_states.float(), self.weight.float())
        else:
            logits = F.linear(hidden_states, self.weight)
        return self.topk(logits, self.e_score_correction_bias)
