"""OLMoE (arXiv:2409.02060)."""

from __future__ import annotations

from moe.models.causal_lm import MoEForCausalLM


class OlmoeForCausalLM(MoEForCausalLM):
    """OLMoE: GQA with q_norm / k_norm, softmax routing, no shared experts."""
