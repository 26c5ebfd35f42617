"""``ArchitectureSpec``: everything that makes one architecture differ from the generic decoder.

One module per architecture (``moe.models.mixtral``, ``moe.models.olmoe``, ...) holds a ``SPEC``
and the parser of its ``config.json``; ``moe.models.architectures`` lists those modules. The
generic stack (``moe.models.decoder``) reads the spec: which attention, how the checkpoint names
the MoE block, its experts and shared experts, the router's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moe.fused_moe.experts import GATE_UP_DOWN_EXPERT_NAMES

ATTENTION_KINDS = ("gqa", "mla")
ROUTER_DTYPES = ("model", "float32")
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def every_layer_sparse(hf_config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """The default layer pattern: a MoE block in every layer."""
    return (True,) * num_layers


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitectureSpec:
    """One architecture, declared.

    Attributes:
        model_type: ``config.json``'s ``model_type`` (``"mixtral"``).
        architecture: the class name in ``config.json``'s ``architectures``
            (``"MixtralForCausalLM"``).
        parse_config: ``config.json`` dict -> ``MoEModelConfig`` keyword arguments (shapes, routing,
            RoPE, attention options; not ``architecture`` / ``moe_layers``, which come from here).
            Raises ``KeyError`` for a missing field, ``ValueError`` for a bad one
            (``moe.models.hf_config`` readers).
        attention: ``"gqa"`` (q/k/v projections, ``moe.layers.attention``) or ``"mla"``
            (DeepSeek latent attention, ``moe.layers.mla``).
        moe_layers: ``(config.json dict, num_hidden_layers) -> tuple[bool, ...]``, True where the
            layer has a MoE block, False for a dense MLP.
        moe_block: checkpoint name of a layer's MoE block (``model.layers.{i}.{moe_block}``).
        expert_names: our stacked expert weight (``w1`` gate, ``w2`` down, ``w3`` up) -> the
            checkpoint's per-expert name (``...experts.{e}.{name}.weight``).
        shared_experts: checkpoint name of the shared-expert MLP inside the MoE block ("" if the
            architecture has none; its size is ``MoEModelConfig.shared_intermediate_size``).
        has_shared_expert_gate: the shared output is scaled by ``sigmoid(shared_expert_gate(x))``.
        router_dtype: ``"float32"`` to compute router logits in float32 whatever the model dtype,
            ``"model"`` to use the model's dtype.

    Raises:
        ValueError: an unknown attention kind or router dtype, or expert names other than w1/w2/w3.
    """

    model_type: str
    architecture: str
    parse_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    attention: str = "gqa"
    moe_layers: Callable[[Mapping[str, Any], int], tuple[bool, ...]] = every_layer_sparse
    moe_block: str = "mlp"
    expert_names: Mapping[str, str] = field(default_factory=lambda: GATE_UP_DOWN_EXPERT_NAMES)
    shared_experts: str = ""
    has_shared_expert_gate: bool = False
    router_dtype: str = "model"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"{self.architecture}: attention {self.attention!r} is not one of {ATTENTION_KINDS}"
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"{self.architecture}: router_dtype {self.router_dtype!r} is not one of "
                f"{ROUTER_DTYPES}"
            )
        if tuple(sorted(self.expert_names)) != EXPERT_WEIGHTS:
            raise ValueError(
                f"{self.architecture}: expert_names must map exactly {EXPERT_WEIGHTS}, got "
                f"{sorted(self.expert_names)}"
            )
        if self.has_shared_expert_gate and not self.shared_experts:
            raise ValueError(f"{self.architecture}: a shared expert gate needs shared_experts")
