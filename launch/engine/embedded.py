"""Synthetic prompts for the embedded default model (``moe.model_loader.EMBEDDED_MODEL_CONFIG``).

They let the main command run with no checkpoint download, and they are sized so that with 2 DP
ranks both the prefill step (~1300 tokens per rank, above the 512-token prefill threshold) and the
decode steps (40 requests per rank, above the 32-token decode threshold even when a few stop early
at the eos token) are microbatched by DBO.
"""

from __future__ import annotations

import random

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
