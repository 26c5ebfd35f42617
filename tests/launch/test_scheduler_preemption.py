"""Scheduler with incremental KV blocks: preemption and resume, token budget, ubatch splits.

A fake paged "model" stores each computed token in the KV slot the block table gives it and derives
the next token from what it reads back through the block table, so a wrong block table, a stale
slot after preemption, or a lost or duplicated token changes the outputs.
"""

from __future__ import annotations

import random

import pytest

from dbo import UBatchWrapper, make_ubatch_slices
from dbo.forward_context import ForwardContext, set_forward_context
from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.request import Request, SamplingParams
from launch.engine.scheduler import Scheduler
from moe.layers.attention_metadata import split_attn_metadata
from tests.helpers.precision import assert_same_sums
from tests.helpers.single_rank import single_rank_engine


class FakePagedModel:
    """Writes token ids into a flat slot array and samples hash(tokens read back) % 97 + 3."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots = [None] * (kv.num_blocks * kv.block_size)

    def step(self, out) -> dict[int, int]:
        sampled = {}
        for item in out.scheduled:
            r = item.request
            start, stop = r.num_computed_tokens, r.num_computed_tokens + item.num_new_tokens
            for pos, tok in zip(range(start, stop), r.token_ids(start, stop), strict=True):
                self.slots[self.kv.slot(r.request_id, pos)] = (r.request_id, tok)
            if stop == r.num_tokens:
                seen = [self.slots[self.kv.slot(r.request_id, p)] for p in range(stop)]
                assert all(s is not None and s[0] == r.request_id for s in seen), "stale KV slot"
                sampled[r.request_id] = hash(tuple(s[1] for s in seen)) % 97 + 3
        return sampled


def run(prompts, *, num_blocks, budget=16, max_num_seqs=8, max_tokens=12, block_size=4):
    """Generate to completion; return (outputs by request id, preemptions, max tokens per step)."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    sched = Scheduler(
        kv_cache_manager=kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=128,
    )
    model = FakePagedModel(kv)
    for i, prompt in enumerate(prompts):
        sched.add_request(
            Request(
                request_id=i,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=max_tokens),
            )
        )
    outputs, num_preempted, max_step = {}, 0, 0
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.num_tokens <= budget and len(out.scheduled) <= max_num_seqs
        assert len(sched.running) <= max_num_seqs
        num_preempted += len(out.preempted)
        max_step = max(max_step, out.num_tokens)
        for r in sched.update_from_output(out, model.step(out)):
            outputs[r.request_id] = list(r.output_token_ids)
        held = sum(len(kv.block_ids(r.request_id)) for r in sched.running)
        assert held + kv.num_free_blocks == num_blocks  # no block leaked or shared
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == num_blocks
    return outputs, num_preempted, max_step


PROMPTS = [
    [random.Random(i).randrange(3, 100) for _ in range(n)]
    for i, n in enumerate((9, 14, 5, 22, 7, 11))
]


def test_preemption_and_resume_give_the_outputs_of_a_run_without_preemption():
    reference, num_preempted, _ = run(PROMPTS, num_blocks=200)
    assert num_preempted == 0
    for num_blocks in (9, 12, 20):  # 9 blocks of 4 = one 34-token request at a time, at worst
        outputs, num_preempted, _ = run(PROMPTS, num_blocks=num_blocks)
        assert num_preempted > 0, num_blocks
        assert outputs == reference, num_blocks


def test_preempts_the_most_recently_admitted_and_requeues_it_first():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
    )
    for i in range(3):
        params = SamplingParams(max_tokens=8)
        sched.add_request(Request(request_id=i, prompt_token_ids=[5] * 4, sampling_params=params))
    out = sched.schedule()  # 3 prompts of one block each: the cache is full
    assert [s.request.request_id for s in out.scheduled] == [0, 1, 2]
    sched.update_from_output(out, {0: 7, 1: 7, 2: 7})
    # every decode needs a second block: 0 preempts 2 and takes its block; 1 finds none, and as
    # the most recently admitted running request left it preempts itself
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == [0]
    assert [r.request_id for r in out.preempted] == [2, 1]
    assert [r.request_id for r in sched.waiting] == [1, 2]  # front of the queue, admission order
    assert all(r.num_computed_tokens == 0 and r.output_token_ids == [7] for r in sched.waiting)
    assert kv.num_free_blocks == 1
    sched.update_from_output(out, {0: 8})
    out = sched.schedule()  # request 1 must recompute 5 tokens (2 blocks): it waits
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1)]
    sched.update_from_output(out, {0: 9})
    sched.abort_request(0)
    out = sched.schedule()  # resumed: prompt + the token generated before preemption (2 blocks)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [(1, 5)]
    assert not out.is_decode_only  # a resumed request recomputes as a prefill
    assert not sched.update_from_output(out, {1: 10})
    assert sched.running[0].output_token_ids == [7, 10]


def test_request_alone_preempts_itself_when_even_its_own_blocks_are_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
    )
    sched.add_request(
        Request(
            request_id=0, prompt_token_ids=[5] * 4, sampling_params=SamplingParams(max_tokens=4)
        )
    )
    sched.add_request(
        Request(
            request_id=1, prompt_token_ids=[5] * 4, sampling_params=SamplingParams(max_tokens=4)
        )
    )
    out = sched.schedule()
    sched.update_from_output(out, {0: 7, 1: 7})
    out = sched.schedule()  # 0 preempts 1 and takes its block
    assert [s.request.request_id for s in out.scheduled] == [0] and [
        r.request_id for r in out.preempted
    ] == [1]
    with pytest.raises(ValueError, match="needs 3 KV blocks but the cache has 2"):
        sched.add_request(
            Request(
                request_id=2, prompt_token_ids=[5] * 9, sampling_params=SamplingParams(max_tokens=2)
            )
        )


@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_chunked_prefill_budget_holds_and_does_not_change_outputs(budget):
    reference, _, _ = run(PROMPTS, num_blocks=200, budget=200)
    outputs, _, max_step = run(PROMPTS, num_blocks=200, budget=budget)
    assert max_step <= budget
    assert outputs == reference


def test_abort_frees_blocks_of_running_and_waiting_requests():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64
    )
    for i in range(2):
        sched.add_request(
            Request(request_id=i, prompt_token_ids=[5] * 6, sampling_params=SamplingParams())
        )
    sched.schedule()
    assert kv.num_free_blocks == 6
    assert sched.abort_request(0).finish_reason == "abort"
    assert sched.abort_request(1).finish_reason == "abort"
    assert sched.abort_request(1) is None
    assert kv.num_free_blocks == 8 and not sched.has_unfinished()


def test_engine_preemption_matches_transformers(
    tiny_mixtral_dir, tiny_prompts, transformers_greedy
):
    """The real model with a KV cache too small for all prompts: preempted requests are recomputed
    and every output still equals transformers' greedy continuation."""
    engine = single_rank_engine(
        tiny_mixtral_dir, dtype="float64", num_gpu_blocks_override=12, max_num_batched_tokens=24
    )
    for i, prompt in enumerate(tiny_prompts):
        engine.add_request(
            Request(
                request_id=i,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=8),
            )
        )
    finished = engine.run_until_done()
    assert engine.observability.stats.num_preemptions > 0
    assert [
        r.output_token_ids for r in sorted(finished, key=lambda r: r.request_id)
    ] == transformers_greedy


def test_requests_split_across_ubatches_give_the_same_hidden_states(tiny_mixtral_dir, tiny_prompts):
    """A step of decodes plus a prefill chunk, cut in two ubatches in the middle of a request, runs
    through the ping-pong wrapper and yields the hidden states of the unsplit batch."""
    engine = single_rank_engine(tiny_mixtral_dir, dtype="float64", max_num_batched_tokens=20)
    for i, prompt in enumerate(tiny_prompts[:4]):
        engine.add_request(
            Request(
                request_id=i,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=8),
            )
        )
    engine.step()  # prompts 0, 1 and 2 (5 + 12 + 3 tokens): the budget of 20
    out = engine.scheduler.schedule()  # 3 decodes, then prompt 3 (20 tokens) chunked to 17
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 17),
    ]
    inputs = engine.model_runner.input_batch.prepare_inputs(out, num_rows=out.num_tokens)
    slices = make_ubatch_slices(inputs.attn_metadata.query_start_loc, out.num_tokens)
    cut = set(range(slices[0].request_slice.start, slices[0].request_slice.stop)) & set(
        range(slices[1].request_slice.start, slices[1].request_slice.stop)
    )
    assert len(cut) == 1, slices  # one request runs in both ubatches
    (cut_index,) = cut
    assert out.scheduled[cut_index].num_new_tokens > 1  # it is a prefill chunk
    md = inputs.attn_metadata
    with set_forward_context(ForwardContext(attn_metadata=md)):
        plain = engine.model_runner._forward(inputs.input_ids, inputs.positions)
    # the ubatched run writes the same K/V into the same slots again: the cache state is unchanged
    wrapper = UBatchWrapper(engine.model_runner._forward, timeout_s=60)
    scopes = [
        set_forward_context(ForwardContext(attn_metadata=ubatch_md, ubatch_id=k))
        for k, ubatch_md in enumerate(split_attn_metadata(slices, md))
    ]
    split = wrapper(inputs.input_ids, inputs.positions, slices, ubatch_scopes=scopes)
    assert_same_sums(split, plain)  # float64: exact up to summation order
