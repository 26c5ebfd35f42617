"""The profile step before a KV cache is sized from free device memory (vLLM's ``profile_run``).

One forward of the largest batch a step holds, ``num_tokens`` (``--max-num-batched-tokens``)
dummy prefill tokens in requests of at most ``max_model_len`` tokens, and the logits of up to
``max_num_seqs`` rows, on a provisional KV cache just large enough for it: the allocator's peak
then covers the weights and the activations of any step. Collective over EP: every rank runs it at
the same point of its start-up with the same token count, as it runs a step.
"""

from __future__ import annotations

import itertools
import math

import torch

from dbo.forward_context import DPMetadata, ForwardContext, set_forward_context
from moe.layers.attention_metadata import CommonAttentionMetadata


def profile_metadata(
    num_tokens: int, *, max_model_len: int, block_size: int
) -> tuple[CommonAttentionMetadata, int]:
    """(host metadata of ``num_tokens`` prefill tokens in requests of ``max_model_len`` tokens
    (the last one shorter), each on its own consecutive blocks; the number of blocks they use).

    Raises:
        ValueError: ``num_tokens``, ``max_model_len`` or ``block_size`` below 1.
    """
    if min(num_tokens, max_model_len, block_size) < 1:
        raise ValueError(
            f"num_tokens, max_model_len and block_size must be >= 1, got {num_tokens}, "
            f"{max_model_len} and {block_size}"
        )
    num_full, rest = divmod(num_tokens, max_model_len)
    query_lens = [max_model_len] * num_full + ([rest] if rest else [])
    blocks = [math.ceil(q / block_size) for q in query_lens]
    first_block = [0, *itertools.accumulate(blocks)][:-1]
    width = max(blocks)
    block_table = torch.tensor(
        [
            [first + b if b < n else 0 for b in range(width)]
            for first, n in zip(first_block, blocks, strict=True)
        ],
        dtype=torch.int32,
    )
    starts = zip(first_block, query_lens, strict=True)
    slots = torch.cat([first * block_size + torch.arange(q) for first, q in starts])
    lens = torch.tensor(query_lens, dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=torch.cat(
            [torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)]
        ),
        seq_lens=lens,
        block_table=block_table,
        slot_mapping=slots.to(torch.int64),
        num_reqs=len(query_lens),
        num_actual_tokens=num_tokens,
        num_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
    )
    return metadata, sum(blocks)


def profile_run(
    model: torch.nn.Module,
    *,
    num_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    dtype: torch.dtype,
    groups,
) -> None:
    """Run the profile step (module docstring) on ``model`` (``CausalLM``-like: ``forward(input_ids,
    positions, attn_metadata)``, ``compute_logits``, ``allocate_kv_caches``) on ``groups.device``.
    The provisional cache stays bound until the real one replaces it.

    Raises:
        ValueError: as ``profile_metadata``.
    """
    metadata, num_blocks = profile_metadata(
        num_tokens, max_model_len=max_model_len, block_size=block_size
    )
    model.allocate_kv_caches(num_blocks=num_blocks, block_size=block_size, dtype=dtype)
    qsl = metadata.query_start_loc.tolist()  # host metadata: no device read
    positions = torch.cat([torch.arange(qsl[r + 1] - qsl[r]) for r in range(metadata.num_reqs)])
    context = ForwardContext(
        attn_metadata=metadata,
        # every rank runs num_tokens rows: the all-to-all knows the counts, as in a step
        dp_metadata=DPMetadata(
            num_tokens_across_dp=(num_tokens,) * groups.dp_size,
            dp_rank_of_ep_rank=groups.dp_rank_of_ep_rank,
        ),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=groups.device)
    with torch.inference_mode(), set_forward_context(context):
        hidden_states = model(input_ids, positions.to(groups.device), metadata)
        model.compute_logits(hidden_states[: min(max_num_seqs, num_tokens)])
