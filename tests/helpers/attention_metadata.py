"""Hand-built ``CommonAttentionMetadata`` shared by the dbo and moe tests."""

from __future__ import annotations

import torch

from moe.layers.attention_metadata import CommonAttentionMetadata

BLOCK_SIZE = 4  # KV cache block size of make_paged_metadata


def make_slicing_metadata(query_lens, seq_lens, num_tokens=None, num_blocks_per_req=3):
    """Metadata with block_table row r = [10r, 10r+1, ...] and slot_mapping[t] = 100 + t (real
    tokens) / -1 (padding), so slices are easy to recognise."""
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_actual = qsl[-1]
    num_tokens = num_actual if num_tokens is None else num_tokens
    slots = [100 + t for t in range(num_actual)] + [-1] * (num_tokens - num_actual)
    num_reqs = len(query_lens)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.arange(num_reqs * num_blocks_per_req, dtype=torch.int32).reshape(
            num_reqs, num_blocks_per_req
        )
        * 10,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=num_reqs,
        num_actual_tokens=num_actual,
        num_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def make_paged_metadata(query_lens, seq_lens, block_tables, num_padding=0):
    """Hand-built metadata: request r owns blocks block_tables[r]; token j of its context sits at
    slot block_tables[r][j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE."""
    qsl = [0]
    slots = []
    for q, s, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        qsl.append(qsl[-1] + q)
        for pos in range(s - q, s):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots += [-1] * num_padding
    width = max(len(b) for b in block_tables)
    table = [b + [0] * (width - len(b)) for b in block_tables]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=len(query_lens),
        num_actual_tokens=qsl[-1],
        num_tokens=qsl[-1] + num_padding,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
