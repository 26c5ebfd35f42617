"""Scheduler and KV block allocator: chunked prefill budget, admission, stopping, block reuse."""

import pytest

from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.request import Request, SamplingParams
from launch.engine.scheduler import Scheduler


def make_scheduler(*, num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=64):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(
        kv_cache_manager=kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        eos_token_ids=(2,),
    )


def req(request_id, num_prompt, max_tokens=4):
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(10, 10 + num_prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    sched = make_scheduler(budget=16)
    for i, n in enumerate([10, 12]):
        sched.add_request(req(i, n))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [(0, 10), (1, 6)]
    assert not out.is_decode_only
    sched.update_from_output(out, {0: 7})  # request 1 is mid-prompt: samples nothing
    out = sched.schedule()
    # the decode of request 0 (1 token) and the rest of request 1's prompt (6 tokens)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 6)]
    sched.update_from_output(out, {0: 8, 1: 9})
    out = sched.schedule()
    assert out.is_decode_only and out.num_tokens == 2


def test_admission_is_bounded_by_max_num_seqs_and_kv_blocks():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        sched.add_request(req(i, 5))
    assert [s.request.request_id for s in sched.schedule().scheduled] == [0, 1]

    # blocks are taken as tokens are scheduled: 5-token prompts take 2 blocks of 4 each, so a
    # 5-block cache admits two of them and leaves the third waiting
    small = make_scheduler(num_blocks=5, budget=100)
    for i in range(3):
        small.add_request(req(i, 5))
    out = small.schedule()
    assert [s.request.request_id for s in out.scheduled] == [0, 1]
    assert small.kv_cache_manager.num_free_blocks == 1
    assert [r.request_id for r in small.waiting] == [2]


def test_stop_on_eos_and_max_tokens_frees_blocks():
    sched = make_scheduler()
    sched.add_request(req(0, 3, max_tokens=3))
    sched.add_request(req(1, 3, max_tokens=3))
    out = sched.schedule()
    assert sched.update_from_output(out, {0: 5, 1: 2}) == [sched_req := out.scheduled[1].request]
    assert sched_req.finish_reason == "stop" and sched_req.output_token_ids == [2]
    for token in (6, 7):
        finished = sched.update_from_output(sched.schedule(), {0: token})
    assert [r.request_id for r in finished] == [0]
    assert finished[0].output_token_ids == [5, 6, 7] and finished[0].finish_reason == "length"
    assert not sched.has_unfinished()
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_generation_stops_at_max_model_len():
    sched = make_scheduler(max_model_len=6)
    sched.add_request(req(0, 4, max_tokens=10))
    out = sched.schedule()
    sched.update_from_output(out, {0: 5})
    finished = sched.update_from_output(sched.schedule(), {0: 6})
    assert finished and finished[0].num_tokens == 6 and finished[0].finish_reason == "length"


def test_prompt_errors_name_the_limit():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match=r"prompt of 8 tokens .* --max-model-len 8"):
        sched.add_request(req(0, 8))
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add_request(req(1, 0))


def test_request_token_ids_span_prompt_and_output():
    r = req(0, 3)
    r.output_token_ids += [1, 2]
    assert r.token_ids(0, 5) == [10, 11, 12, 1, 2]
    assert r.token_ids(2, 4) == [12, 1]
    assert r.token_ids(4, 5) == [2]


def test_kv_slots_follow_block_table():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(7, 2)
    kv.allocate(8, 4)
    kv.allocate(7, 6)  # grows to 2 blocks
    assert kv.block_ids(7) == [0, 2] and kv.block_ids(8) == [1]
    assert [kv.slot(7, p) for p in range(6)] == [0, 1, 2, 3, 8, 9]
    assert not kv.allocate(9, 8)  # only 1 block left
    kv.free(7)
    assert kv.num_free_blocks == 3
