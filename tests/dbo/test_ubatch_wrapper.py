"""UBatchWrapper: DBO on equals DBO off for a toy paged-attention model that reads its metadata
from the forward context; each ubatch runs in its own scope; failures surface once."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from dbo import (
    UBatchWrapper,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    make_ubatch_slices,
)
from dbo.forward_context import ForwardContext, get_forward_context, set_forward_context
from moe.layers.attention_metadata import CommonAttentionMetadata, split_attn_metadata

BLOCK_SIZE = 4
NUM_LAYERS = 3


class ToyPagedModel:
    """Per layer: write each token's state into a paged cache at ``slot_mapping``, then give each
    token the sum of its request's cached states at positions 0..pos (read through
    ``block_table``), then an "MoE" with a recv hook and a yield. A cut request is only right if
    the metadata slices are right and ubatch 0 writes its part before ubatch 1 reads it."""

    def __init__(self, num_blocks: int, cached: dict[int, float]):
        self.caches = [torch.zeros(num_blocks * BLOCK_SIZE) for _ in range(NUM_LAYERS)]
        for cache in self.caches:
            for slot, value in cached.items():
                cache[slot] = value
        self.hooks_run = []

    def __call__(self, input_ids, positions):
        md = get_forward_context().attn_metadata
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        state = input_ids.to(torch.float64)
        for layer, cache in enumerate(self.caches):
            real = md.slot_mapping >= 0
            cache[md.slot_mapping[real]] = state[real].to(cache.dtype)
            out = torch.zeros_like(state)
            for r, seq_len in enumerate(seq_lens):
                for t in range(qsl[r], qsl[r + 1]):
                    pos = seq_len - (qsl[r + 1] - t)
                    assert pos == positions[t], "positions disagree with the metadata"
                    blocks = md.block_table[r, torch.arange(pos + 1) // BLOCK_SIZE].long()
                    slots = blocks * BLOCK_SIZE + torch.arange(pos + 1) % BLOCK_SIZE
                    out[t] = cache[slots].to(torch.float64).sum()
            dbo_maybe_run_recv_hook()
            registered_by = dbo_current_ubatch_id()
            dbo_register_recv_hook(
                lambda i=registered_by: self.hooks_run.append((i, dbo_current_ubatch_id()))
            )
            dbo_yield()
            state = state + 0.5 * out + layer
        return torch.stack([state, positions.to(torch.float64)], dim=1)


def make_batch():
    """r0: fresh prefill of 7 tokens; r1: decode with 4 cached tokens; r2: 3 new tokens on 2
    cached; padded from 11 to 12 rows, so the split point 6 cuts r0.
    Blocks: r0 -> 0,1; r1 -> 2,3; r2 -> 4,5."""
    query_lens, seq_lens = [7, 1, 3], [7, 5, 5]
    block_table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    input_ids, positions, slots = [], [], []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(s - q, s):
            input_ids.append(10 * r + pos + 1)
            positions.append(pos)
            slots.append(int(block_table[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_padding = 1
    input_ids += [0] * num_padding
    positions += [0] * num_padding
    slots += [-1] * num_padding
    md = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 7, 8, 11], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=3,
        num_actual_tokens=11,
        num_tokens=12,
        max_query_len=7,
        max_seq_len=7,
    )
    # KV of earlier steps: r1 positions 0..3 (block 2), r2 positions 0..1 (block 4)
    cached = {2 * BLOCK_SIZE + p: 100.0 + p for p in range(4)}
    cached.update({4 * BLOCK_SIZE + p: 200.0 + p for p in range(2)})
    return torch.tensor(input_ids), torch.tensor(positions), md, cached


def run(model_fn, input_ids, positions, md, slices=None, *, timeout_s=5.0):
    """``model_fn`` through a UBatchWrapper as the model runner calls it: inside the batch's
    forward context, and each ubatch inside its own (its slice of ``md``)."""
    scopes = None
    if slices:
        scopes = [
            set_forward_context(ForwardContext(attn_metadata=ubatch_md, ubatch_id=k))
            for k, ubatch_md in enumerate(split_attn_metadata(slices, md))
        ]
    with set_forward_context(ForwardContext(attn_metadata=md)):
        return UBatchWrapper(model_fn, timeout_s=timeout_s)(
            input_ids, positions, slices, ubatch_scopes=scopes
        )


def test_without_slices_calls_the_model_directly():
    seen = []

    def model_fn(input_ids, positions):
        seen.append((threading.current_thread() is threading.main_thread(), dbo_enabled()))
        return input_ids * 2

    input_ids, positions, md, _ = make_batch()
    out = UBatchWrapper(model_fn, timeout_s=5)(input_ids, positions)
    assert torch.equal(out, input_ids * 2)
    assert seen == [(True, False)]


def test_each_ubatch_runs_inside_its_own_scope():
    events = []

    @contextlib.contextmanager
    def scope(k):
        events.append(("enter", k, dbo_current_ubatch_id(), threading.current_thread().name))
        yield
        events.append(("exit", k))

    def model_fn(input_ids, positions):
        events.append(("model", dbo_current_ubatch_id()))
        dbo_yield()
        return input_ids

    input_ids, positions, md, _ = make_batch()
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens, 3)
    wrapper = UBatchWrapper(model_fn, timeout_s=5)
    out = wrapper(input_ids, positions, slices, ubatch_scopes=[scope(k) for k in range(3)])
    assert torch.equal(out, input_ids)
    # entered in the ubatch's thread, inside its ubatch context (holding the baton), in ring order
    assert [e for e in events if e[0] == "enter"] == [
        ("enter", k, k, f"ubatch{k}") for k in range(3)
    ]
    assert sorted(e for e in events if e[0] == "exit") == [("exit", k) for k in range(3)]
    with pytest.raises(ValueError, match="2 ubatch_scopes for 3 ubatch_slices"):
        wrapper(input_ids, positions, slices, ubatch_scopes=[scope(0), scope(1)])


# (request_slice, token_slice) per ubatch of make_batch's 12 rows (r0: rows 0-6, r1: 7, r2: 8-10)
EXPECTED_SLICES = {
    # r0 cut: its first 6 tokens in ubatch 0, its 7th in ubatch 1 (with the padding row)
    2: [(slice(0, 1), slice(0, 6)), (slice(0, 3), slice(6, 12))],
    # r0 cut at row 4, r2 whole in the last ubatch with the padding row
    3: [(slice(0, 1), slice(0, 4)), (slice(0, 2), slice(4, 8)), (slice(2, 3), slice(8, 12))],
    # r0 cut across three ubatches (rows 0-2, 3-5, 6), r2 across two
    4: [
        (slice(0, 1), slice(0, 3)),
        (slice(0, 1), slice(3, 6)),
        (slice(0, 3), slice(6, 9)),
        (slice(2, 3), slice(9, 12)),
    ],
}


@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
def test_dbo_on_equals_dbo_off(num_ubatches):
    input_ids, positions, md, cached = make_batch()
    reference_model = ToyPagedModel(8, cached)
    reference = run(reference_model, input_ids, positions, md)

    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens, num_ubatches)
    assert [(s.request_slice, s.token_slice) for s in slices] == EXPECTED_SLICES[num_ubatches]
    dbo_model = ToyPagedModel(8, cached)
    out = run(dbo_model, input_ids, positions, md, slices)

    assert out.shape == reference.shape == (12, 2)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    for dbo_cache, ref_cache in zip(dbo_model.caches, reference_model.caches, strict=True):
        torch.testing.assert_close(dbo_cache, ref_cache, rtol=0, atol=0)
    # each layer's hook of ubatch k ran in the ubatch before it in the ring, the last one to run
    # before k resumes (with two ubatches: the other one)
    assert sorted(dbo_model.hooks_run) == sorted(
        (k, (k - 1) % num_ubatches) for k in range(num_ubatches) for _ in range(NUM_LAYERS)
    )


def _failing_model(fail_in: int, error: BaseException):
    def model_fn(input_ids, positions):
        dbo_yield()
        if dbo_current_ubatch_id() == fail_in:
            raise error
        dbo_yield()
        return input_ids

    return model_fn


@pytest.mark.parametrize(
    ("num_ubatches", "fail_in"), [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (4, 0), (4, 3)]
)
def test_exception_surfaces_once_as_the_original(num_ubatches, fail_in, monkeypatch):
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    input_ids, positions, md, _ = make_batch()
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens, num_ubatches)
    error = ValueError(f"boom in ubatch {fail_in}")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"boom in ubatch {fail_in}") as caught:
        run(_failing_model(fail_in, error), input_ids, positions, md, slices)
    assert caught.value is error
    assert time.perf_counter() - start < 2.5  # woken, not timed out
    assert thread_errors == []  # nothing else escaped a thread


def test_peer_that_never_yields_back_raises_timeout_error():
    release = threading.Event()

    def model_fn(input_ids, positions):
        if dbo_current_ubatch_id() == 1:
            release.wait(10)  # keeps the baton and never yields back
        dbo_yield()
        return input_ids

    input_ids, positions, md, _ = make_batch()
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    start = time.perf_counter()
    try:
        # 0.5 s: the watchdog (timeout plus as much grace) then leaves ubatch 0 half a second to
        # raise its own error first, even on a loaded 2-core machine (0.2 s was seen to lose)
        with pytest.raises(TimeoutError, match="ubatch 0 waited 0.5 s for the baton"):
            run(model_fn, input_ids, positions, md, slices, timeout_s=0.5)
    finally:
        release.set()
    assert time.perf_counter() - start < 3.0


def test_wrapper_can_run_again_after_a_failure():
    input_ids, positions, md, cached = make_batch()
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    with pytest.raises(RuntimeError, match="first"):
        run(_failing_model(0, RuntimeError("first")), input_ids, positions, md, slices)
    out = run(ToyPagedModel(8, cached), input_ids, positions, md, slices)
    reference = run(ToyPagedModel(8, cached), input_ids, positions, md)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
