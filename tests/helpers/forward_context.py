"""Running a model through ``UBatchWrapper`` as the model runner does: each ubatch inside its own
forward context (its slice of the attention metadata), the model reading the metadata from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from torch import Tensor

from dbo import UBatchSlice
from dbo.forward_context import DPMetadata, ForwardContext, get_forward_context, set_forward_context
from moe.layers.attention_metadata import CommonAttentionMetadata, split_attn_metadata


def ubatch_scopes(
    slices: Sequence[UBatchSlice],
    md: CommonAttentionMetadata,
    dp_metadata: Callable[[UBatchSlice], DPMetadata | None] = lambda s: None,
) -> list[AbstractContextManager[ForwardContext]]:
    """``UBatchWrapper``'s ``ubatch_scopes``: ubatch k's forward context holds its slice of ``md``
    and ``dp_metadata(slices[k])`` (default None: the all-to-all exchanges its counts)."""
    return [
        set_forward_context(
            ForwardContext(attn_metadata=ubatch_md, dp_metadata=dp_metadata(s), ubatch_id=k)
        )
        for k, (s, ubatch_md) in enumerate(
            zip(slices, split_attn_metadata(slices, md), strict=True)
        )
    ]


def context_forward(model: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """``model(input_ids, positions, attn_metadata)`` as a ``UBatchWrapper`` model function: the
    metadata of the thread's forward context."""
    return lambda input_ids, positions: model(
        input_ids, positions, get_forward_context().attn_metadata
    )
