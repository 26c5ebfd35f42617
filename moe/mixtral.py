"""Per-architecture model classes: each is the generic ``MoEForCausalLM``, registered under the
architecture name its ``config.json`` gives (the class only names the architecture; the config
carries every difference)."""

from __future__ import annotations

from moe.causal_lm import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: GQA attention, top-2 softmax routing, no shared experts."""


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2: MLA, dense first layers, shared experts, greedy / group-limited routing."""


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """DeepSeek-V3: as V2, with sigmoid scores + correction bias and no-aux-loss grouped top-k."""


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: GQA with qkv bias, shared expert gated by a sigmoid, sparse-step layers."""


class OlmoeForCausalLM(MoEForCausalLM):
    """OLMoE: GQA with q_norm / k_norm, softmax routing, no shared experts."""
