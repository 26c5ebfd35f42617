"""Index math of the emulated DeepEP low-latency protocol, against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from distributed.all2all.deepep_low_latency_protocol import (
    BlockLayout,
    expert_positions,
    peer_splits,
    slot_order,
    valid_rows,
)


def test_expert_positions_count_earlier_pairs_per_expert():
    topk_idx = torch.tensor([[2, 0], [0, -1], [2, 1]])
    per_expert, position = expert_positions(topk_idx, num_experts=4)
    assert per_expert.tolist() == [2, 1, 2, 0]
    assert position.tolist() == [[0, 0], [1, -1], [1, 0]]


def test_valid_rows_pack_sources_in_rank_order():
    layout = torch.tensor([[2, 0], [1, 1]])  # [R=2 sources, L=2 local experts]
    rank, expert, row, block_row, packed_row = valid_rows(layout, capacity=2)
    assert rank.tolist() == [0, 0, 1, 1]
    assert expert.tolist() == [0, 0, 0, 1]
    assert row.tolist() == [0, 1, 0, 0]
    assert block_row.tolist() == [0, 1, 0, 1]  # expert-major inside each source's block
    assert packed_row.tolist() == [0, 1, 2, 0]  # source 1's row of expert 0 after source 0's


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
    row = block.flat_row(torch.tensor([2]), torch.tensor([3]))
    assert row.tolist() == [2 * block.rows_per_block + block.num_header_rows + 3]
    # the token rows never overlap the counts
    buf.view(-1, hidden)[block.flat_row(torch.arange(3), torch.zeros(3, dtype=torch.long))] = 0
    assert block.counts(buf).tolist() == torch.arange(12).view(3, 4).tolist()
