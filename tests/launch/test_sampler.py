"""Top-p filtering and logprobs of sampled tokens, against plain references."""

from __future__ import annotations

import pytest
import torch

from launch.engine.request import SamplingParams
from launch.engine.sampler import apply_top_p, compute_logprobs


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
