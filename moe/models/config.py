"""Model configuration parsed from a Hugging Face ``config.json`` dict.

Only the fields the engine needs are kept; unknown keys are ignored. Supported architectures are
the specs registered in ``moe.models.architectures`` (one module per architecture, which also
parses its ``config.json``); anything else raises ``ValueError`` naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe.fused_moe.router import SCORING_FUNCS, TOPK_METHODS
from moe.models.architectures import (
    spec_for_architecture,
    spec_for_model_type,
    supported_architectures,
)
from moe.models.spec import ArchitectureSpec


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEModelConfig:
    """Shape and numerics of a decoder-only MoE model (any supported architecture).

    Sizes: ``intermediate_size`` is the DENSE MLP's (dense layers); ``moe_intermediate_size`` one
    routed expert's (Mixtral: both equal ``intermediate_size``); ``shared_intermediate_size`` the
    shared expert MLP's (0: none). ``num_experts`` counts routed experts per layer in the whole
    model, not per EP rank. ``moe_layers[i]`` says whether layer i is sparse (else dense MLP).

    Attention: ``attention_type`` (the architecture spec's) "gqa" (q/k/v projections,
    ``head_dim``; ``qkv_bias``, ``o_bias``, ``qk_norm`` (over the whole q / k projection, or with
    ``qk_norm_per_head`` over each head's ``head_dim``), ``clip_qkv`` options) or "mla" (DeepSeek
    multi-head latent attention: ``q_lora_rank`` (None: plain q_proj), ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``). RoPE: ``rope_theta``,
    ``rope_scaling`` (yarn parameters as sorted (key, value) pairs, or None), ``rope_interleave``
    (rotate adjacent pairs). Routing fields mirror ``moe.router.RoutingConfig``.
    """

    architecture: str = "MixtralForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int | None = None  # None: intermediate_size
    moe_layers: tuple[bool, ...] | None = None  # None: every layer is sparse
    shared_intermediate_size: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_per_head: bool = False
    clip_qkv: float | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_interleave: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        spec_for_architecture(self.architecture)  # ValueError naming the supported ones
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.moe_layers is None:
            object.__setattr__(self, "moe_layers", (True,) * self.num_hidden_layers)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ):
            _positive(name, getattr(self, name))
        if len(self.moe_layers) != self.num_hidden_layers:
            raise ValueError(
                f"moe_layers has {len(self.moe_layers)} entries, expected num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        self._check_attention()
        self._check_routing()
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    @property
    def spec(self) -> ArchitectureSpec:
        """The architecture's declaration (``moe.models.spec``)."""
        return spec_for_architecture(self.architecture)

    @property
    def attention_type(self) -> str:
        """``"gqa"`` or ``"mla"``, as the architecture declares."""
        return self.spec.attention

    @property
    def has_shared_expert_gate(self) -> bool:
        """Whether the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE)."""
        return self.spec.has_shared_expert_gate and self.shared_intermediate_size > 0

    def _check_attention(self) -> None:
        if self.attention_type == "gqa":
            if self.num_attention_heads % self.num_key_value_heads:
                raise ValueError(
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_key_value_heads ({self.num_key_value_heads})"
                )
            if self.head_dim % 2:
                raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        else:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _positive(name, getattr(self, name))
            if self.q_lora_rank is not None:
                _positive("q_lora_rank", self.q_lora_rank)
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    def _check_routing(self) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.scoring_func not in SCORING_FUNCS or self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r} / topk_method {self.topk_method!r} not "
                f"supported; scoring in {SCORING_FUNCS}, topk_method in {TOPK_METHODS}"
            )
        if self.shared_intermediate_size < 0:
            raise ValueError(
                f"shared_intermediate_size must be >= 0, got {self.shared_intermediate_size}"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> MoEModelConfig:
        """Build from a HF ``config.json`` dict.

        Raises:
            ValueError: unsupported ``model_type``/``architectures`` (the message names the
                supported ones), or a missing / invalid field.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config.json must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        spec = spec_for_model_type(model_type) if isinstance(model_type, str) else None
        if spec is None:
            archs = d.get("architectures")
            raise ValueError(
                f"unsupported model (model_type={model_type!r}, architectures={archs!r}); "
                f"supported architectures: {sorted(supported_architectures().values())}"
            )
        try:
            fields = spec.parse_config(d)
            num_layers = fields["num_hidden_layers"]
            moe_layers = spec.moe_layers(d, num_layers)
            return cls(architecture=spec.architecture, moe_layers=moe_layers, **fields)
        except KeyError as e:
            raise ValueError(f"HF config for {model_type!r} is missing field {e.args[0]!r}") from e
