"""Shared fixtures: a tiny Mixtral checkpoint saved by transformers, and prompts for it."""

from __future__ import annotations

import json
import random

import pytest

TINY_MIXTRAL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    """A sharded float32 Mixtral checkpoint written by transformers' ``save_pretrained`` (offline)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1234)
    model = MixtralForCausalLM(MixtralConfig(**TINY_MIXTRAL)).eval()
    path = tmp_path_factory.mktemp("tiny_mixtral")
    model.save_pretrained(path, max_shard_size="40KB")
    return str(path)


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """Nine prompts of 3 to 20 tokens (ids 3..127, so none is the eos id 2)."""
    rng = random.Random(7)
    return [[rng.randrange(3, 128) for _ in range(n)] for n in (5, 12, 3, 20, 7, 9, 16, 4, 11)]


@pytest.fixture(scope="session")
def tiny_prompts_file(tmp_path_factory, tiny_prompts) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in tiny_prompts))
    return str(path)


@pytest.fixture(scope="session")
def transformers_greedy(tiny_mixtral_dir, tiny_prompts) -> list[list[int]]:
    """transformers' greedy continuation (8 new tokens, stops at eos) of each prompt, one by one."""
    import torch
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(tiny_mixtral_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in tiny_prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
