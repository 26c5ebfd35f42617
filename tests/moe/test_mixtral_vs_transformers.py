"""Our Mixtral (paged KV cache, DP=1, NoEP) vs transformers' MixtralForCausalLM on one checkpoint.

Teacher forcing: two requests with different prompt lengths are prefilled through the paged cache
in one batch, then decoded one token per request per step; every logit row must match the
transformers forward over the full sequence: in float64 within ``reference_rel`` of the largest
|logit|, and in float32 (against the same float64 reference) within 2**-14 of it
(``tests.helpers.precision``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe import build_model, load_checkpoint, load_config  # noqa: E402
from tests.conftest import make_tiny_mixtral  # noqa: E402
from tests.helpers.attention_metadata import BLOCK_SIZE, make_paged_metadata  # noqa: E402
from tests.helpers.precision import (  # noqa: E402
    FLOAT32_REL,
    assert_logits_close,
    reference_model,
    reference_rel,
)

NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ref = make_tiny_mixtral(seed=0, num_local_experts=4, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("mixtral") / "ckpt"
    ref.save_pretrained(path, max_shard_size="20KB")
    return path, reference_model(path)


@pytest.mark.parametrize(
    ("dtype", "rel"), [(torch.float64, reference_rel("mixtral")), (torch.float32, FLOAT32_REL)]
)
def test_prefill_then_decode_matches_transformers(checkpoint, dtype, rel):
    path, ref = checkpoint
    model = build_model(load_config(path), dtype=dtype)
    load_checkpoint(model, path)
    model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)  # also binds them

    gen = torch.Generator().manual_seed(1)
    prompt_lens, num_decode = [7, 3], 4
    seqs = [torch.randint(0, 128, (n + num_decode,), generator=gen) for n in prompt_lens]
    # Non-contiguous, interleaved blocks to exercise the block_table indirection.
    block_tables = [[5, 2, 9], [11, 0]]
    with torch.no_grad():
        expected = [ref(input_ids=s[None]).logits[0] for s in seqs]
    assert expected[0].dtype == torch.float64

    # Prefill both prompts in one batch, plus 2 padding rows.
    ids = torch.cat(
        [s[:n] for s, n in zip(seqs, prompt_lens, strict=True)] + [torch.zeros(2, dtype=torch.long)]
    )
    pos = torch.cat([torch.arange(n) for n in prompt_lens] + [torch.zeros(2, dtype=torch.long)])
    meta = make_paged_metadata(prompt_lens, prompt_lens, block_tables, num_padding=2)
    hidden = model(ids, pos, meta)
    assert hidden.shape == (sum(prompt_lens) + 2, 32)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.promote_types(dtype, torch.float32)
    assert_logits_close(logits[:7], expected[0][:7], rel=rel)
    assert_logits_close(logits[7:10], expected[1][:3], rel=rel)

    # Decode steps: one token per request, appended through the cache.
    for step in range(num_decode):
        seq_lens = [n + step + 1 for n in prompt_lens]
        ids = torch.stack([s[n - 1] for s, n in zip(seqs, seq_lens, strict=True)])
        pos = torch.tensor([n - 1 for n in seq_lens])
        meta = make_paged_metadata([1, 1], seq_lens, block_tables)
        logits = model.compute_logits(model(ids, pos, meta))
        for r in range(2):
            assert_logits_close(logits[r], expected[r][seq_lens[r] - 1], rel=rel)


def test_padding_rows_write_no_cache(checkpoint):
    path, _ = checkpoint
    model = build_model(load_config(path))
    load_checkpoint(model, path)
    caches = model.allocate_kv_caches(4, BLOCK_SIZE)
    model.bind_kv_caches(caches)
    meta = make_paged_metadata([2], [2], [[1]], num_padding=3)
    model(torch.tensor([3, 4, 0, 0, 0]), torch.tensor([0, 1, 0, 0, 0]), meta)
    for cache in caches:
        touched = cache.abs().sum(dim=(0, 3, 4)) != 0  # [num_blocks, block_size]
        assert touched.nonzero().tolist() == [[1, 0], [1, 1]]


def test_bind_kv_caches_validates(checkpoint):
    path, _ = checkpoint
    model = build_model(load_config(path))
    with pytest.raises(ValueError, match=r"expected 2 KV caches"):
        model.bind_kv_caches(model.allocate_kv_caches(4, BLOCK_SIZE)[:1])
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, num_blocks, block_size, 2, 8\]"):
        model.bind_kv_caches([torch.zeros(2, 4, 4, 4, 8)] * 2)
