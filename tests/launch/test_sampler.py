"""Sampler: greedy = argmax; seeded sampling depends only on (seed, output position, logits row),
not on the batch around it; Gumbel-max draws from softmax(logits / T); the hash is lowbias32;
top-p filtering (single row and batched) and logprobs of sampled tokens against plain references."""

from __future__ import annotations

import math

import pytest
import torch

from launch.engine.request import SamplingParams
from launch.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_p,
    compute_logprobs,
    hash_uniform,
    mix32,
    top_p_mask,
)


def lowbias32(x: int) -> int:
    """Plain-Python reference of Chris Wellons' lowbias32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def metadata(temperature, seeds, positions, top_p=None) -> SamplingMetadata:
    top_p = [1.0] * len(seeds) if top_p is None else top_p
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        num_logprobs=(-1,) * len(seeds),
        seeds=torch.tensor(seeds, dtype=torch.int64),
        output_positions=torch.tensor(positions, dtype=torch.int64),
        is_all_greedy=not any(temperature),
        has_top_p=any(t > 0 and p < 1 for t, p in zip(temperature, top_p, strict=True)),
    )


def test_mix32_matches_python_reference():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens = Sampler()(logits, metadata([0.0] * 5, [1] * 5, [0] * 5))
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [7, 512, 32000])
def test_greedy_breaks_ties_as_argmax(vocab):
    """Greedy takes max's indices: on rows full of ties (integer logits in [0, 3]), +-inf and NaN
    (NaN counts as maximal) it picks argmax's token, the first maximal one."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 4, (64, vocab), generator=gen).to(torch.float32)
    logits[1, vocab // 2] = float("nan")
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")
    logits[4, :] = 1.0
    tokens = Sampler()(logits, metadata([0.0] * 64, list(range(64)), [0] * 64))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_seeded_row_independent_of_batch():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(200, generator=gen)
    others = torch.randn(6, 200, generator=gen)
    alone = Sampler()(row[None], metadata([0.8], [42], [5]))
    batch = torch.cat((others[:3], row[None], others[3:]))
    mixed = Sampler()(
        batch,
        metadata(
            [0.0, 1.0, 0.5, 0.8, 0.0, 2.0, 1.0], [1, 2, 3, 42, 5, 6, 7], [0, 9, 3, 5, 1, 5, 5]
        ),
    )
    assert mixed[3] == alone[0]
    assert mixed[0] == others[0].argmax() and mixed[4] == others[3].argmax()


def test_draws_vary_with_seed_and_position():
    logits = torch.zeros(1, 1000)  # uniform: every token equally likely
    draws = {
        int(Sampler()(logits, metadata([1.0], [seed], [pos]))[0])
        for seed in range(5)
        for pos in range(5)
    }
    assert len(draws) > 20  # 25 draws from 1000 tokens: collisions are rare


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gumbel_max_follows_softmax(temperature):
    """40,000 draws (one per output position) of 4 tokens: each frequency within 5 sigma."""
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 40_000
    tokens = Sampler()(logits.expand(n, 4), metadata([temperature] * n, [7] * n, list(range(n))))
    counts = torch.bincount(tokens, minlength=4).double()
    probs = torch.softmax(logits.double() / temperature, -1)
    sigma = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() < 5 * sigma).all(), (counts / n, probs)


def test_uniforms_in_open_unit_interval():
    u = hash_uniform(torch.tensor([0, -1, 2**40 + 3]), torch.tensor([0, 1, 2**20]), 4096)
    assert u.dtype == torch.float64 and u.min() > 0 and u.max() < 1
    assert math.isclose(float(u.mean()), 0.5, abs_tol=0.01)
    # 64-bit seeds: the high half matters
    assert not torch.equal(
        hash_uniform(torch.tensor([3]), torch.tensor([0]), 8),
        hash_uniform(torch.tensor([3 + 2**32]), torch.tensor([0]), 8),
    )


def _sampled_outputs(model_dir, prompts, request_ids, **engine_overrides):
    """(output tokens by request id, number of preemptions)."""
    from launch.engine.request import Request, SamplingParams
    from tests.helpers.single_rank import single_rank_engine

    engine = single_rank_engine(model_dir, **engine_overrides)
    for request_id in request_ids:
        engine.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompts[request_id % len(prompts)]),
                sampling_params=SamplingParams(
                    max_tokens=8, temperature=1.0, seed=1000 + request_id
                ),
            )
        )
    outputs = {r.request_id: r.output_token_ids for r in engine.run_until_done()}
    return outputs, engine.observability.stats.num_preemptions


def test_engine_seeded_request_same_tokens_in_any_batch(tiny_mixtral_dir, tiny_prompts):
    """Request 2 (temperature 1, seed 1002) alone, in a batch of 8, and in a batch whose small KV
    cache forces preemptions (recompute): the same tokens every time."""
    alone = _sampled_outputs(tiny_mixtral_dir, tiny_prompts, [2])[0][2]
    batched, _ = _sampled_outputs(tiny_mixtral_dir, tiny_prompts, range(8))
    preempted, num_preemptions = _sampled_outputs(
        tiny_mixtral_dir,
        tiny_prompts,
        range(8),
        num_gpu_blocks_override=12,
        max_num_batched_tokens=24,
    )
    assert num_preemptions > 0
    assert batched[2] == alone and preempted[2] == alone
    assert preempted == batched
    assert len({tuple(t) for t in batched.values()}) > 1  # different seeds, different tokens


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert apply_top_p(probs, 1.0) is probs
    assert apply_top_p(probs, 0.4).tolist() == pytest.approx([0, 0.4, 0, 0])
    assert apply_top_p(probs, 0.41).tolist() == pytest.approx([0, 0.4, 0, 0.3])
    assert apply_top_p(probs, 0.7).tolist() == pytest.approx([0, 0.4, 0, 0.3])
    assert apply_top_p(probs, 0.75).tolist() == pytest.approx([0, 0.4, 0.2, 0.3])
    assert apply_top_p(probs, 1e-9).tolist() == pytest.approx([0, 0.4, 0, 0])  # argmax kept


def test_top_p_sampling_never_leaves_the_nucleus():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(50), dim=-1)
    kept = apply_top_p(probs, 0.5)
    draws = torch.multinomial(kept, 2000, replacement=True)
    assert set(draws.tolist()) <= set(torch.nonzero(kept).view(-1).tolist())
    ordered = torch.sort(probs, descending=True).values
    num_kept = int((kept > 0).sum())
    assert ordered[: num_kept - 1].sum() < 0.5 <= ordered[:num_kept].sum()


def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 40, dtype=torch.float64) * 3
    tokens = torch.tensor([5, int(logits[1].argmax()), 0])
    out = compute_logprobs(logits, tokens, [0, 3, 20])
    reference = torch.log_softmax(logits, dim=-1)
    for row, lp in enumerate(out):
        assert lp.token_id == int(tokens[row])
        assert lp.logprob == pytest.approx(float(reference[row, tokens[row]]), abs=1e-12)
    assert out[0].top_token_ids == () and out[0].top_logprobs == ()
    top = torch.topk(reference[1], 3)
    assert out[1].top_token_ids == tuple(top.indices.tolist())
    assert out[1].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-12)
    assert out[1].logprob == out[1].top_logprobs[0]  # the greedy token is the row's max
    assert len(out[2].top_token_ids) == 20


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"top_p": 0.0}, r"top_p must be in \(0, 1\]"), ({"logprobs": 21}, r"\[0, 20\]")],
)
def test_sampling_params_checks(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_batched_top_p_mask_matches_apply_top_p():
    """Per row, the tokens the batched mask keeps are those apply_top_p keeps (top_p 1: all)."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 60, generator=gen, dtype=torch.float64) * 2
    top_p = torch.tensor([0.3, 0.9, 1.0, 1e-6, 0.75])
    masked = top_p_mask(scores, top_p)
    for row in range(5):
        kept = apply_top_p(torch.softmax(scores[row], -1).float(), float(top_p[row])) > 0
        assert torch.equal(torch.isfinite(masked[row]), kept), row
    assert torch.equal(masked[2], scores[2])


def test_top_p_samples_stay_in_the_nucleus_and_follow_it():
    """20,000 draws at top_p 0.7 of 4 tokens: only the nucleus, in its renormalised proportions."""
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 20_000
    tokens = Sampler()(
        logits.expand(n, 4), metadata([1.0] * n, [9] * n, list(range(n)), top_p=[0.7] * n)
    )
    probs = torch.softmax(logits.double(), -1)
    nucleus = apply_top_p(probs.float(), 0.7).double()
    assert set(tokens.tolist()) == set(nucleus.nonzero().flatten().tolist())
    expected = nucleus / nucleus.sum()
    counts = torch.bincount(tokens, minlength=4).double()
    sigma = (n * expected * (1 - expected)).sqrt()
    assert ((counts - n * expected).abs() <= 5 * sigma + 1e-9).all(), (counts / n, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_p_that_rounded_to_zero_keeps_the_most_likely_token(dtype):
    """Issue 28 case 2: top_p 7e-46 is 0 in float32; the mask must still keep the top token
    (it used to mask every token, and every sampled token was id 0)."""
    scores = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    top_p = torch.tensor([7e-46, 0.0], dtype=dtype)
    masked = top_p_mask(scores, top_p)
    assert torch.isfinite(masked).tolist() == [[False, True, False, False], [True] + [False] * 3]
    probs = torch.softmax(scores[0].float(), -1)
    assert apply_top_p(probs, 7e-46).nonzero().flatten().tolist() == [1]
    tokens = Sampler()(scores.float(), metadata([1.0, 1.0], [3, 4], [0, 0], top_p=[7e-46, 1e-45]))
    assert tokens.tolist() == [1, 0]
