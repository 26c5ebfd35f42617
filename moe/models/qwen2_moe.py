"""Qwen2-MoE (Qwen1.5-MoE, arXiv:2407.10671)."""

from __future__ import annotations

from moe.models.causal_lm import MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: GQA with qkv bias, shared expert gated by a sigmoid, sparse-step layers."""
