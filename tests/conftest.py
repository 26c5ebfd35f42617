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


def make_tiny_mixtral(*, seed: int, **overrides):
    """transformers' MixtralForCausalLM on ``TINY_MIXTRAL`` (with ``overrides``), built offline.

    HF's init (std 0.02) makes every logit ~0, so matrices are redrawn with std 0.3 (embeddings
    1.0): logits of a few units make a 1e-5 comparison and greedy ties meaningful.
    """
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**TINY_MIXTRAL, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 1.0 if "embed" in name else 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    """A sharded float32 Mixtral checkpoint written by transformers' ``save_pretrained`` (offline)."""
    path = tmp_path_factory.mktemp("tiny_mixtral")
    make_tiny_mixtral(seed=1234).save_pretrained(path, max_shard_size="40KB")
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
