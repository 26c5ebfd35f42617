"""The embedded default: a small Mixtral-like model with seeded random weights; synthetic prompts.

It lets the main command run with no checkpoint download, and it is sized so that with 2 DP ranks
both the prefill step (~1300 tokens per rank, above the 512-token prefill threshold) and the decode
steps (40 requests per rank, above the 32-token decode threshold even when a few stop early at
the eos token) are microbatched by DBO.
"""

from __future__ import annotations

import random

# A Hugging Face config.json for MixtralForCausalLM, as transformers would write it.
EMBEDDED_MODEL_CONFIG: dict = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": None,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

NUM_SYNTHETIC_PROMPTS = 80


def synthetic_prompts(
    *, seed: int, vocab_size: int, num_prompts: int = NUM_SYNTHETIC_PROMPTS
) -> list[list[int]]:
    """``num_prompts`` prompts of 16 to 48 token ids in [3, vocab_size), the same for every seed."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 48))]
        for _ in range(num_prompts)
    ]
