"""DeepSeek-V2 (arXiv:2405.04434) and DeepSeek-V3 (arXiv:2412.19437): MLA and DeepSeekMoE routing."""

from __future__ import annotations

from moe.models.causal_lm import MoEForCausalLM


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2: MLA, dense first layers, shared experts, greedy / group-limited routing."""


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """DeepSeek-V3: as V2, with sigmoid scores + correction bias and no-aux-loss grouped top-k."""
