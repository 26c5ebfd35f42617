"""InputBatch builds the same step inputs as a per-token reference, through chunked prefill, decode,
block growth, preemption with recompute into new blocks, finished requests and row reuse."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from launch.engine.input_batch import InputBatch
from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.request import Request, SamplingParams
from launch.engine.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def reference_inputs(out: SchedulerOutput, kv: KVCacheManager, num_rows: int) -> dict:
    """The per-token loop the InputBatch replaces (kept here as the reference)."""
    ids, pos, slots, qsl, seq_lens, logits, req_ids = [], [], [], [0], [], [], []
    for item in out.scheduled:
        r, start = item.request, item.request.num_computed_tokens
        stop = start + item.num_new_tokens
        ids += r.token_ids(start, stop)
        pos += range(start, stop)
        slots += [kv.slot(r.request_id, p) for p in range(start, stop)]
        qsl.append(len(ids))
        seq_lens.append(stop)
        if stop == r.num_tokens:
            logits.append(len(ids) - 1)
            req_ids.append(r.request_id)
    pad = num_rows - len(ids)
    return {
        "input_ids": ids + [0] * pad,
        "positions": list(pos) + [0] * pad,
        "slot_mapping": slots + [-1] * pad,
        "query_start_loc": qsl,
        "seq_lens": seq_lens,
        "logits_indices": logits,
        "sampled_request_ids": tuple(req_ids),
        "block_tables": [kv.block_ids(s.request.request_id) for s in out.scheduled],
    }


def check_inputs(batch: InputBatch, out: SchedulerOutput, kv: KVCacheManager, num_rows: int):
    inputs = batch.prepare_inputs(out, num_rows=num_rows)
    want = reference_inputs(out, kv, num_rows)
    md = inputs.attn_metadata
    assert inputs.input_ids.tolist() == want["input_ids"]
    assert inputs.positions.tolist() == want["positions"]
    assert md.slot_mapping.tolist() == want["slot_mapping"]
    assert md.query_start_loc.tolist() == want["query_start_loc"]
    assert md.seq_lens.tolist() == want["seq_lens"]
    assert inputs.logits_indices.tolist() == want["logits_indices"]
    assert inputs.sampled_request_ids == want["sampled_request_ids"]
    for row, blocks in zip(md.block_table.tolist(), want["block_tables"], strict=True):
        assert row[: len(blocks)] == blocks
    assert (md.num_tokens, md.num_actual_tokens) == (num_rows, want["query_start_loc"][-1])
    assert inputs.input_ids.dtype == inputs.positions.dtype == torch.int64
    return inputs


def make_batch(kv: KVCacheManager, max_num_reqs: int = 8) -> InputBatch:
    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=MAX_MODEL_LEN,
        max_num_blocks_per_req=MAX_MODEL_LEN // BLOCK_SIZE,
        kv_cache_manager=kv,
        default_seed=0,
    )


@pytest.mark.parametrize("num_blocks", [12, 64])
def test_matches_reference_through_preemption_and_reuse(num_blocks):
    rng = random.Random(num_blocks)
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN
    )
    batch = make_batch(kv, max_num_reqs=4)
    for i in range(10):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.randrange(1, 14))
        sched.add_request(Request(request_id=i, prompt_token_ids=prompt, sampling_params=params))
    num_preemptions = num_steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        num_preemptions += len(out.preempted)
        num_rows = out.num_tokens + num_steps % 3  # some steps padded
        inputs = check_inputs(batch, out, kv, num_rows)
        sampled = {r: (7 * r + num_steps) % 500 for r in inputs.sampled_request_ids}
        for request in sched.update_from_output(out, sampled):
            batch.remove_request(request.request_id)
        num_steps += 1
    assert batch.num_reqs == 0
    if num_blocks == 12:
        assert num_preemptions > 0  # the small cache forces recompute into new blocks


def test_dummy_batch_and_bad_num_rows():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    batch = make_batch(kv)
    inputs = check_inputs(batch, SchedulerOutput(scheduled=()), kv, 1)
    assert inputs.attn_metadata.num_reqs == 0 and inputs.sampled_request_ids == ()
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN
    )
    sched.add_request(
        Request(request_id=0, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams())
    )
    with pytest.raises(ValueError, match="num_rows 2 < 3 scheduled tokens"):
        batch.prepare_inputs(sched.schedule(), num_rows=2)


def test_sampling_metadata_per_request():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    batch = make_batch(kv)
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN
    )
    sched.add_request(
        Request(
            request_id=3,
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(temperature=0.5, seed=11, top_p=0.9, logprobs=2),
        )
    )
    sched.add_request(Request(request_id=4, prompt_token_ids=[5], sampling_params=SamplingParams()))
    out = sched.schedule()
    meta = batch.prepare_inputs(out, num_rows=3).sampling_metadata
    assert meta.temperature.tolist() == [0.5, 0.0] and not meta.is_all_greedy
    assert meta.seeds.tolist() == [11, 0 + 4]  # default seed + request id
    assert meta.top_p.tolist() == [pytest.approx(0.9), 1.0]
    assert meta.num_logprobs == (2, -1) and meta.has_top_p
    assert meta.output_positions.tolist() == [0, 0]
    sched.update_from_output(out, {3: 9, 4: 9})
    meta = batch.prepare_inputs(sched.schedule(), num_rows=2).sampling_metadata
    assert meta.output_positions.tolist() == [1, 1]


@pytest.mark.parametrize("top_p", [7e-46, 1e-300, 5e-324])
def test_a_tiny_top_p_is_held_and_samples_the_most_likely_token(top_p):
    """Issue 28 case 2: a top_p that float32 rounds to 0 is held as given (float64), and the
    sampler still draws the most likely token (the nucleus always keeps it)."""
    from launch.engine.sampler import Sampler

    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    batch = make_batch(kv)
    sched = Scheduler(
        kv_cache_manager=kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN
    )
    params = SamplingParams(temperature=1.0, seed=5, top_p=top_p)
    sched.add_request(Request(request_id=0, prompt_token_ids=[1, 2], sampling_params=params))
    meta = batch.prepare_inputs(sched.schedule(), num_rows=2).sampling_metadata
    assert meta.top_p.tolist() == [top_p] and meta.top_p.dtype == torch.float64
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1))
    logits[0, 0] = logits.min() - 1  # token 0 least likely: the old bug's answer
    for position in range(20):  # every draw: the greedy token
        meta = dataclasses.replace(meta, output_positions=torch.tensor([position]))
        assert Sampler()(logits, meta).tolist() == logits.argmax(-1).tolist()
