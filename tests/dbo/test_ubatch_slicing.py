"""Ubatch slicing of a flat batch (dbo) and of its attention metadata (moe), checked against
hand-worked cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dbo import UBatchSlice, make_ubatch_slices
from dbo.ubatch_slicing import max_num_ubatches, ubatch_bounds
from moe.layers.attention_metadata import CommonAttentionMetadata, split_attn_metadata
from tests.helpers.attention_metadata import make_slicing_metadata


def positions_of(md: CommonAttentionMetadata) -> list[int]:
    """Query positions implied by the metadata (seq_len - q_len .. seq_len - 1 per request)."""
    qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    positions = []
    for r, seq_len in enumerate(seq_lens):
        q = qsl[r + 1] - qsl[r]
        positions.extend(range(seq_len - q, seq_len))
    return positions


def test_prefill_request_cut_in_the_middle():
    # r0: fresh prefill of 6 tokens, r1: decode (11 cached), r2: 3 new tokens on 5 cached
    md = make_slicing_metadata([6, 1, 3], [6, 12, 8])
    slices = make_ubatch_slices(md.query_start_loc, 10)
    assert slices == [
        UBatchSlice(request_slice=slice(0, 1), token_slice=slice(0, 5)),
        UBatchSlice(request_slice=slice(0, 3), token_slice=slice(5, 10)),
    ]
    ub0, ub1 = split_attn_metadata(slices, md)
    # first part of r0: 5 of its 6 tokens, seq_len reduced by the 1 token that moved on
    assert ub0.query_start_loc.tolist() == [0, 5]
    assert ub0.seq_lens.tolist() == [5]
    assert ub0.block_table.tolist() == [[0, 10, 20]]
    assert ub0.slot_mapping.tolist() == [100, 101, 102, 103, 104]
    assert (ub0.num_reqs, ub0.num_actual_tokens, ub0.num_tokens) == (1, 5, 5)
    assert (ub0.max_query_len, ub0.max_seq_len) == (5, 5)
    # continuation of r0 keeps the full seq_len; query_start_loc rebased to 0
    assert ub1.query_start_loc.tolist() == [0, 1, 2, 5]
    assert ub1.seq_lens.tolist() == [6, 12, 8]
    assert ub1.block_table.tolist() == md.block_table.tolist()
    assert ub1.slot_mapping.tolist() == [105, 106, 107, 108, 109]
    assert (ub1.num_reqs, ub1.num_actual_tokens, ub1.num_tokens) == (3, 5, 5)
    assert (ub1.max_query_len, ub1.max_seq_len) == (3, 12)
    # every token keeps its position
    assert positions_of(ub0) + positions_of(ub1) == positions_of(md)
    # the original metadata is untouched
    assert md.seq_lens.tolist() == [6, 12, 8]


def test_padding_rows_go_to_the_last_ubatch():
    # r0: 3 new tokens on 1 cached, r1: 2 new tokens on 7 cached; padded from 5 to 8 rows
    md = make_slicing_metadata([3, 2], [4, 9], num_tokens=8)
    slices = make_ubatch_slices([0, 3, 5], 8)
    assert slices == [
        UBatchSlice(request_slice=slice(0, 2), token_slice=slice(0, 4)),
        UBatchSlice(request_slice=slice(1, 2), token_slice=slice(4, 8)),
    ]
    assert [s.num_tokens for s in slices] == [4, 4]
    ub0, ub1 = split_attn_metadata(slices, md)
    assert ub0.query_start_loc.tolist() == [0, 3, 4]
    assert ub0.seq_lens.tolist() == [4, 8]  # r1 cut: 1 of its 2 tokens moved on
    assert (ub0.num_actual_tokens, ub0.num_tokens) == (4, 4)
    assert ub1.query_start_loc.tolist() == [0, 1]
    assert ub1.seq_lens.tolist() == [9]
    assert ub1.block_table.tolist() == [[30, 40, 50]]
    assert ub1.slot_mapping.tolist() == [104, -1, -1, -1]
    assert (ub1.num_reqs, ub1.num_actual_tokens, ub1.num_tokens) == (1, 1, 4)
    assert (ub1.max_query_len, ub1.max_seq_len) == (1, 9)
    assert positions_of(ub0) + positions_of(ub1) == positions_of(md)


def test_decode_only_batch_splits_between_requests():
    md = make_slicing_metadata([1, 1, 1, 1], [5, 7, 2, 9])
    slices = make_ubatch_slices(md.query_start_loc, 4)
    assert [(s.request_slice, s.token_slice) for s in slices] == [
        (slice(0, 2), slice(0, 2)),
        (slice(2, 4), slice(2, 4)),
    ]
    ub0, ub1 = split_attn_metadata(slices, md)
    assert ub0.query_start_loc.tolist() == [0, 1, 2] == ub1.query_start_loc.tolist()
    assert ub0.seq_lens.tolist() == [5, 7]
    assert ub1.seq_lens.tolist() == [2, 9]
    assert ub1.block_table.tolist() == [[60, 70, 80], [90, 100, 110]]
    assert (ub0.max_query_len, ub0.max_seq_len, ub1.max_seq_len) == (1, 7, 9)


def test_odd_count_and_split_on_a_request_boundary():
    # 5 rows: split point 5 // 2 = 2 falls exactly on the boundary after r0
    slices = make_ubatch_slices([0, 2, 5], 5)
    assert [(s.request_slice, s.token_slice) for s in slices] == [
        (slice(0, 1), slice(0, 2)),
        (slice(1, 2), slice(2, 5)),
    ]


def test_one_request_over_three_ubatches():
    md = make_slicing_metadata([9], [9])
    slices = make_ubatch_slices([0, 9], 9, num_ubatches=3)
    assert [s.token_slice for s in slices] == [slice(0, 3), slice(3, 6), slice(6, 9)]
    parts = split_attn_metadata(slices, md)
    assert [p.seq_lens.tolist() for p in parts] == [[3], [6], [9]]
    assert [p.query_start_loc.tolist() for p in parts] == [[0, 3]] * 3
    assert sum((positions_of(p) for p in parts), []) == list(range(9))


@pytest.mark.parametrize("num_ubatches", [3, 4])
def test_mixed_batch_over_n_ubatches_keeps_every_position(num_ubatches):
    # a prefill continuation (5 new on 3 cached), two decodes, a fresh prefill of 6; 14 -> 16 rows
    md = make_slicing_metadata([5, 1, 1, 6], [8, 4, 7, 6], num_tokens=16)
    qsl = md.query_start_loc.tolist()
    slices = make_ubatch_slices(qsl, 16, num_ubatches)
    assert [s.token_slice.start for s in slices] == ubatch_bounds(16, num_ubatches)[:-1]
    parts = split_attn_metadata(slices, md)
    assert sum(p.num_tokens for p in parts) == 16
    assert all(p.num_actual_tokens >= 1 for p in parts)  # no empty ubatch
    assert sum((positions_of(p) for p in parts), []) == positions_of(md)
    # a cut request's last part keeps its full seq_len, earlier parts end where they stop
    assert parts[-1].seq_lens.tolist()[-1] == 6


def test_max_num_ubatches_is_the_most_without_an_empty_ubatch():
    assert ubatch_bounds(10, 4) == [0, 2, 5, 7, 10]
    assert max_num_ubatches(16, 16, 4) == 4
    assert max_num_ubatches(16, 11, 4) == 3  # of 4 the last starts at row 12
    assert max_num_ubatches(16, 9, 4) == 2
    assert max_num_ubatches(16, 8, 4) == 1  # even the second of two starts past the real tokens
    assert max_num_ubatches(3, 3, 4) == 3  # one row per ubatch at most
    assert max_num_ubatches(1, 1, 2) == 1
    for padded in range(1, 20):
        for real in range(1, padded + 1):
            n = max_num_ubatches(padded, real, 4)
            if n >= 2:  # agrees with what make_ubatch_slices accepts
                make_ubatch_slices([0, real], padded, n)
            if n < 4:
                with pytest.raises(ValueError, match="no real token"):
                    make_ubatch_slices([0, real], padded, n + 1)


def test_errors():
    with pytest.raises(ValueError, match="ubatch 1 of 2.*no real token"):
        make_ubatch_slices([0, 2], 8)  # split point 4 is past both real tokens
    with pytest.raises(ValueError, match="num_tokens_padded=3"):
        make_ubatch_slices([0, 2, 5], 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        make_ubatch_slices([0, 3, 2], 4)
    with pytest.raises(ValueError, match="num_ubatches"):
        make_ubatch_slices([0, 4], 4, num_ubatches=0)
    with pytest.raises(ValueError, match="token_slice"):
        UBatchSlice(request_slice=slice(0, 1), token_slice=slice(3, 1))
    with pytest.raises(ValueError, match="request_slice must have integer start"):
        UBatchSlice(request_slice=slice(None, 1), token_slice=slice(0, 1))
    normalised = UBatchSlice(request_slice=slice(0, 1), token_slice=slice(0, torch.tensor(4)))
    assert normalised.token_slice == slice(0, 4) and type(normalised.num_tokens) is int
    md = make_slicing_metadata([2, 2], [2, 2])
    bad = [UBatchSlice(request_slice=slice(0, 2), token_slice=slice(0, 2))]
    with pytest.raises(ValueError, match="does not cover exactly"):
        split_attn_metadata(bad, md)
    too_far = [UBatchSlice(request_slice=slice(0, 2), token_slice=slice(0, 6))]
    with pytest.raises(ValueError, match="exceeds the batch"):
        split_attn_metadata(too_far, md)


def test_metadata_validation():
    md = make_slicing_metadata([2, 3], [4, 3])
    fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if f.init}
    with pytest.raises(ValueError, match="query_start_loc must be a 1-D torch.int32"):
        CommonAttentionMetadata(**{**fields, "query_start_loc": md.query_start_loc.long()})
    with pytest.raises(ValueError, match="slot_mapping has 5 rows, expected 6"):
        CommonAttentionMetadata(**{**fields, "num_tokens": 6})
    with pytest.raises(ValueError, match="max_query_len/max_seq_len must be 3/4"):
        CommonAttentionMetadata(**{**fields, "max_query_len": 2})
    with pytest.raises(ValueError, match="seq_len must be >= its query length"):
        CommonAttentionMetadata(**{**fields, "seq_lens": torch.tensor([4, 2], dtype=torch.int32)})
    assert md.query_lens.tolist() == [2, 3]
