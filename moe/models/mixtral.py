"""Mixtral (Jiang et al. 2024, arXiv:2401.04088)."""

from __future__ import annotations

from moe.models.causal_lm import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: GQA attention, top-2 softmax routing, no shared experts."""
