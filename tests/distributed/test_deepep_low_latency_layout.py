"""Index math of the emulated DeepEP low-latency protocol, against hand-worked values, and its
debug-only consistency checks."""

from __future__ import annotations

import pytest
import torch

from distributed.all2all.base import DEBUG_CHECKS_ENV, debug_checks_enabled
from distributed.all2all.deepep_low_latency_protocol import (
    BlockLayout,
    block_buffer,
    expert_positions,
    pack_dispatch,
    peer_splits,
    received_rows,
    slot_order,
    unpack_dispatch,
)


def test_expert_positions_count_earlier_pairs_per_expert():
    topk_idx = torch.tensor([[2, 0], [0, -1], [2, 1]])
    per_expert, position = expert_positions(topk_idx, num_experts=4)
    assert per_expert.tolist() == [2, 1, 2, 0]
    assert position.tolist() == [[0, 0], [1, -1], [1, 0]]


def test_received_rows_pack_sources_in_rank_order():
    layout = torch.tensor([[2, 0], [1, 1]])  # [R=2 sources, L=2 local experts]
    local_expert, packed_row, is_valid = received_rows(layout, capacity=2, num_rows=3)
    assert is_valid.tolist() == [[True, True, False], [True, True, False]]  # past each total
    assert local_expert[is_valid].tolist() == [0, 0, 0, 1]  # expert-major inside each block
    assert packed_row[is_valid].tolist() == [0, 1, 2, 0]  # source 1's row of expert 0 after 0's
    assert int(local_expert.max()) < 2  # in range also where invalid
    # more than C rows of one source for one expert (repeated ids): the first C are kept
    _, packed_row, is_valid = received_rows(torch.tensor([[3, 1]]), capacity=2, num_rows=4)
    assert is_valid.tolist() == [[True, True, False, True]]
    assert packed_row[is_valid].tolist() == [0, 1, 0]


def test_slot_order_and_peer_splits():
    assert slot_order(1, 3, own_first=False, device="cpu").tolist() == [0, 2, 1]
    assert slot_order(1, 3, own_first=True, device="cpu").tolist() == [1, 0, 2]
    assert peer_splits([4, 5, 6], 1) == [4, 0, 6]


@pytest.mark.parametrize(("hidden", "itemsize"), [(3, 4), (5, 2), (12, 2), (256, 4), (1, 8)])
def test_block_layout_holds_the_counts_aligned(hidden, itemsize):
    block = BlockLayout.of(capacity=5, num_topk=2, num_local=4, hidden=hidden, itemsize=itemsize)
    assert block.num_rows == 5 * 2
    assert block.num_header_rows * hidden * itemsize >= 8 * 4
    assert block.rows_per_block * hidden * itemsize % 8 == 0
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[itemsize]
    buf = torch.zeros(3, block.rows_per_block, hidden, dtype=dtype)
    block.counts(buf).copy_(torch.arange(12).view(3, 4))
    assert block.counts(buf[1:]).tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    block.src_token_idx(buf).copy_(torch.arange(30).view(3, 10))
    assert block.counts(buf).tolist() == torch.arange(12).view(3, 4).tolist()
    row = block.flat_row(torch.tensor([2]), torch.tensor([3]))
    assert row.tolist() == [2 * block.rows_per_block + block.num_header_rows + 3]
    # the token rows never overlap the header
    buf.view(-1, hidden)[block.flat_row(torch.arange(3), torch.zeros(3, dtype=torch.long))] = 0
    assert block.counts(buf).tolist() == torch.arange(12).view(3, 4).tolist()
    assert block.src_token_idx(buf).tolist() == torch.arange(30).view(3, 10).tolist()


def _dispatch_one_rank(x, topk_idx, capacity, num_experts):
    """``pack_dispatch`` then ``unpack_dispatch`` on one rank, with the checks that
    ``MOE_DBO_DEBUG_CHECKS`` asks for (read as the emulated buffer reads it):
    ``(recv_x, recv_count)``."""
    debug_checks = debug_checks_enabled()
    buf, handle = pack_dispatch(
        x,
        topk_idx,
        capacity,
        num_experts=num_experts,
        rank=0,
        num_ranks=1,
        debug_checks=debug_checks,
    )
    recv_x, recv_rows = block_buffer(num_experts, capacity, x)
    recv_count = torch.zeros(num_experts, dtype=torch.int32)
    unpack_dispatch(buf, handle, recv_rows, recv_count, rank=0, debug_checks=debug_checks)
    return recv_x, recv_count


def test_repeated_expert_ids_are_checked_only_under_debug_checks(monkeypatch):
    x = torch.randn(2, 4)
    # expert 0 three times: 3 rows for rank 0 above B = 1 * min(3, 2); the excess is dropped
    recv_x, recv_count = _dispatch_one_rank(x[:1], torch.zeros(1, 3, dtype=torch.long), 1, 2)
    assert recv_count.tolist() == [1, 0] and torch.equal(recv_x[0, 0], x[0])
    # expert 0 twice per token: 4 rows in B = 2 * min(2, 4), but 4 for one expert above C = 2
    recv_x, recv_count = _dispatch_one_rank(x, torch.zeros(2, 2, dtype=torch.long), 2, 4)
    assert recv_count.tolist() == [2, 0, 0, 0] and torch.equal(recv_x[0, :2], x[[0, 0]])
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    with pytest.raises(
        ValueError,
        match=r"low_latency_dispatch on rank 0: 3 rows for one rank exceed 2 = capacity \* "
        r"min\(num_topk, num_local_experts\): a token names the same expert twice",
    ):
        _dispatch_one_rank(x[:1], torch.zeros(1, 3, dtype=torch.long), 1, 2)
    with pytest.raises(
        RuntimeError,
        match=r"low_latency_dispatch on rank 0: received row counts \[\[4, 0, 0, 0\]\] outside "
        r"\[0, 2\]: the ranks disagree on num_max_dispatch_tokens_per_rank, hidden or dtype",
    ):
        _dispatch_one_rank(x, torch.zeros(2, 2, dtype=torch.long), 2, 4)
