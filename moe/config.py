"""Model configuration parsed from a Hugging Face ``config.json`` dict.

Only the fields the engine needs are kept; unknown keys are ignored. Supported architectures are
listed in ``SUPPORTED_ARCHITECTURES``; anything else raises ``ValueError`` naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# model_type -> architecture class name in config.json
SUPPORTED_ARCHITECTURES: dict[str, str] = {"mixtral": "MixtralForCausalLM"}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEModelConfig:
    """Shape and numerics of a decoder-only MoE model (Mixtral family).

    ``head_dim`` is always resolved (``hidden_size // num_attention_heads`` when the HF config says
    null). ``num_experts`` is HF's ``num_local_experts`` (experts per layer in the whole model, not
    per EP rank).
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
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES.values())}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> MoEModelConfig:
        """Build from a HF ``config.json`` dict.

        Raises:
            ValueError: unsupported ``model_type``/``architectures`` (the message names the supported
                ones), or a missing / invalid field.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = d.get("architectures")
            raise ValueError(
                f"unsupported model (model_type={model_type!r}, architectures={archs!r}); "
                f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES.values())}"
            )
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            head_dim = d.get("head_dim") or hidden_size // num_heads
            return cls(
                architecture=SUPPORTED_ARCHITECTURES[model_type],
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                num_experts=int(d["num_local_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=_rope_theta(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                eos_token_ids=_eos_ids(d.get("eos_token_id")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ValueError(f"HF config for {model_type!r} is missing field {e.args[0]!r}") from e


def _rope_theta(d: Mapping[str, Any]) -> float:
    # transformers >= 5 keeps it in rope_parameters; older configs have a top-level rope_theta.
    params = d.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: ['default']")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(d.get("rope_theta", 1e6))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
