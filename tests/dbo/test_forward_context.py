"""The forward context: nesting and restoration, per-thread isolation across ubatch threads, EP
counts without assuming ep_size == dp_size, and the error outside a forward."""

from __future__ import annotations

import importlib
import threading

import pytest

import dbo
from dbo import UBatchWrapper, dbo_yield, make_ubatch_slices
from dbo.forward_context import (
    DPMetadata,
    ForwardContext,
    current_num_tokens_across_ep,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from dbo.timeline.recorder import set_timeline_layer, timeline_layer
from moe.layers.attention_metadata import split_attn_metadata
from tests.helpers.attention_metadata import make_slicing_metadata


def _context(**kw) -> ForwardContext:
    return ForwardContext(attn_metadata=make_slicing_metadata([2, 3], [2, 5]), **kw)


def test_read_outside_a_forward_raises():
    assert not is_forward_context_available()
    assert current_num_tokens_across_ep() is None
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()


def test_nesting_restores_the_outer_context_and_its_timeline_layer():
    outer = _context(dp_metadata=DPMetadata(num_tokens_across_dp=(5, 7), dp_rank_of_ep_rank=(0, 1)))
    inner = _context()
    set_timeline_layer(3)  # outside a forward there is no layer to name spans after
    assert timeline_layer() is None
    with set_forward_context(outer) as entered:
        assert entered is outer and get_forward_context() is outer
        assert timeline_layer() is None  # a forward starts outside any layer
        set_timeline_layer(1)
        with set_forward_context(inner):
            assert get_forward_context() is inner
            assert current_num_tokens_across_ep() is None  # inner has no DP metadata
            assert timeline_layer() is None
            set_timeline_layer(0)
        assert get_forward_context() is outer and timeline_layer() == 1
        assert current_num_tokens_across_ep() == (5, 7)
    assert not is_forward_context_available() and timeline_layer() is None
    with pytest.raises(KeyError), set_forward_context(outer):
        raise KeyError("restored on an error too")
    assert not is_forward_context_available()


def test_each_ubatch_thread_sees_only_its_own_context():
    md = make_slicing_metadata([6, 1, 3], [6, 12, 8], num_tokens=12)
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens, 3)
    contexts = [
        ForwardContext(
            attn_metadata=ubatch_md,
            dp_metadata=DPMetadata(
                num_tokens_across_dp=(s.num_tokens, 10 + k), dp_rank_of_ep_rank=(0, 1)
            ),
            ubatch_id=k,
        )
        for k, (s, ubatch_md) in enumerate(
            zip(slices, split_attn_metadata(slices, md), strict=True)
        )
    ]
    batch = ForwardContext(attn_metadata=md)
    seen = {}

    def model_fn(input_ids, positions):
        for _ in range(3):  # the baton passes between reads: each thread keeps its own context
            context = get_forward_context()
            seen.setdefault(threading.current_thread().name, set()).add(
                (
                    context.ubatch_id,
                    context.attn_metadata.num_tokens,
                    current_num_tokens_across_ep(),
                )
            )
            dbo_yield()
        return input_ids

    ids = md.slot_mapping
    with set_forward_context(batch):
        UBatchWrapper(model_fn, timeout_s=5)(
            ids, ids, slices, ubatch_scopes=[set_forward_context(c) for c in contexts]
        )
        assert get_forward_context() is batch  # the caller's thread keeps the batch's
    assert seen == {
        f"ubatch{k}": {(k, s.num_tokens, (s.num_tokens, 10 + k))} for k, s in enumerate(slices)
    }


def test_a_ubatch_context_must_match_the_thread():
    no_ubatch = set_forward_context(_context(ubatch_id=1))
    with pytest.raises(ValueError, match="ubatch 1 set in a thread running no ubatch"), no_ubatch:
        pass
    md = make_slicing_metadata([6, 1, 3], [6, 12, 8])
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    swapped = [set_forward_context(_context(ubatch_id=k)) for k in (1, 0)]
    with pytest.raises(ValueError, match="ubatch 1 set in a thread running ubatch 0"):
        UBatchWrapper(lambda ids, pos: ids, timeout_s=5)(
            md.slot_mapping, md.slot_mapping, slices, ubatch_scopes=swapped
        )
    assert not is_forward_context_available()


def test_ep_counts_follow_the_dp_to_ep_mapping():
    # EP over DP ranks x 2 (e.g. two EP ranks per DP rank): each DP rank's count appears twice
    dp = DPMetadata(num_tokens_across_dp=(3, 5), dp_rank_of_ep_rank=(0, 0, 1, 1))
    assert dp.num_tokens_across_ep == (3, 3, 5, 5)
    # ep_size == dp_size is a mapping like any other, not an assumption
    assert DPMetadata(
        num_tokens_across_dp=(3, 5), dp_rank_of_ep_rank=(1, 0)
    ).num_tokens_across_ep == (5, 3)
    # mapping unknown: no EP counts, so the all-to-all exchanges its own
    unknown = DPMetadata(num_tokens_across_dp=(3, 5))
    assert unknown.num_tokens_across_ep is None
    with set_forward_context(_context(dp_metadata=unknown)):
        assert current_num_tokens_across_ep() is None
    with set_forward_context(_context(dp_metadata=dp)):
        assert current_num_tokens_across_ep() == (3, 3, 5, 5)


def test_validation():
    with pytest.raises(ValueError, match=r"num_tokens_across_dp must be >= 1 counts >= 0"):
        DPMetadata(num_tokens_across_dp=(3, -1))
    with pytest.raises(ValueError, match=r"num_tokens_across_dp must be >= 1 counts >= 0"):
        DPMetadata(num_tokens_across_dp=())
    with pytest.raises(ValueError, match=r"DP ranks in \[0, 2\), got \(0, 2\)"):
        DPMetadata(num_tokens_across_dp=(3, 5), dp_rank_of_ep_rank=(0, 2))
    with pytest.raises(ValueError, match="ubatch_id must be None or >= 0, got -1"):
        _context(ubatch_id=-1)


def test_parallel_groups_validate_the_mapping():
    import datetime

    import torch

    from distributed.parallel_state import ParallelGroups

    kw = dict(
        rank=1,
        world_size=2,
        dp_rank=1,
        dp_size=2,
        dp_group=None,
        ep_rank=0,
        ep_size=1,
        ep_group=None,
        device=torch.device("cpu"),
        timeout=datetime.timedelta(seconds=1),
    )
    assert ParallelGroups(**kw, dp_rank_of_ep_rank=(1,)).dp_rank_of_ep_rank == (1,)
    with pytest.raises(ValueError, match=r"entry 0 = dp_rank 1, got \(0,\)"):
        ParallelGroups(**kw, dp_rank_of_ep_rank=(0,))
    with pytest.raises(ValueError, match=r"must list 1 DP ranks"):
        ParallelGroups(**kw, dp_rank_of_ep_rank=(1, 0))


def test_dbo_holds_no_attention_metadata():
    assert not hasattr(dbo, "CommonAttentionMetadata")
    assert not hasattr(dbo, "split_attn_metadata")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dbo.attention_metadata")
