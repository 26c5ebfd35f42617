"""Routing index math and the packed row format of the expert all-to-all.

Routing (DeepEP high-throughput semantics, ``deep_ep.Buffer.get_dispatch_layout`` /
``dispatch``): a token is sent once to every EP rank that holds at least one of its top-k experts
("per destination rank, one row per token"). Experts live on EP ranks in contiguous blocks:
global expert ``e`` is on rank ``e // num_local_experts`` with local id ``e % num_local_experts``.

Row format: one token's ``topk_ids`` (int64), ``topk_weights`` (float32) and hidden state are
packed into one uint8 row so that a dispatch moves ONE payload tensor::

    [ topk_ids: num_topk * 8 B | topk_weights: num_topk * 4 B | pad | hidden: hidden_size * itemsize | pad ]

Fields are ordered by alignment and the row length is padded to 8 bytes, so unpacking is a set of
zero-copy ``view(dtype)`` calls; the bytes round-trip exactly for any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Exchanged with the counts so that ranks disagreeing on the row format fail with a clear error
# instead of a collective with mismatched sizes (which aborts the process).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float64: 3,
}


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True, kw_only=True)
class RowLayout:
    """Byte offsets of the fields of a packed row (see the module docstring)."""

    hidden_size: int
    num_topk: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"hidden_states dtype must be one of {list(DTYPE_CODES)}, got {self.dtype}"
            )
        if self.hidden_size < 1 or self.num_topk < 1:
            raise ValueError(
                f"hidden_size and num_topk must be >= 1, got {self.hidden_size}, {self.num_topk}"
            )

    @property
    def weights_offset(self) -> int:
        return 8 * self.num_topk

    @property
    def hidden_offset(self) -> int:
        return _align(12 * self.num_topk, self.dtype.itemsize)

    @property
    def hidden_bytes(self) -> int:
        return self.hidden_size * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return _align(self.hidden_offset + self.hidden_bytes, 8)

    def signature(self) -> tuple[int, int, int]:
        """(hidden_size, num_topk, dtype code): must agree on every EP rank."""
        return (self.hidden_size, self.num_topk, DTYPE_CODES[self.dtype])


def pack_rows(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    layout: RowLayout,
    *,
    num_rows: int | None = None,
) -> Tensor:
    """Pack rows into one uint8 tensor.

    Args:
        hidden_states: ``[n, hidden_size]``, ``layout.dtype``.
        topk_ids: ``[n, num_topk]`` torch.int64.
        topk_weights: ``[n, num_topk]`` torch.float32.
        num_rows: total rows of the result (>= n); rows past ``n`` are zero padding.

    Returns:
        ``[num_rows, layout.row_bytes]`` torch.uint8.
    """
    n = hidden_states.shape[0]
    num_rows = n if num_rows is None else num_rows
    packed = torch.zeros(num_rows, layout.row_bytes, dtype=torch.uint8, device=hidden_states.device)
    ids, weights, hidden = unpack_rows(packed[:n], layout)
    ids.copy_(topk_ids)
    weights.copy_(topk_weights)
    hidden.copy_(hidden_states)
    return packed


def unpack_rows(packed: Tensor, layout: RowLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-copy views ``(topk_ids int64, topk_weights float32, hidden_states layout.dtype)``.

    Args:
        packed: ``[n, layout.row_bytes]`` torch.uint8 with unit stride along the row.

    Returns:
        ``[n, num_topk]``, ``[n, num_topk]``, ``[n, hidden_size]`` views into ``packed``.
    """
    if packed.dim() != 2 or packed.shape[1] != layout.row_bytes or packed.dtype != torch.uint8:
        raise ValueError(
            f"packed rows must be [n, {layout.row_bytes}] uint8, got {list(packed.shape)} "
            f"{packed.dtype}"
        )
    k = layout.num_topk
    ids = packed[:, : 8 * k].view(torch.int64)
    weights = packed[:, layout.weights_offset : layout.weights_offset + 4 * k].view(torch.float32)
    start = layout.hidden_offset
    hidden = packed[:, start : start + layout.hidden_bytes].view(layout.dtype)
    return ids, weights, hidden


def token_rank_mask(topk_ids: Tensor, *, num_local_experts: int, ep_size: int) -> Tensor:
    """Which EP ranks each token must be sent to (DeepEP's ``is_token_in_rank``).

    Args:
        topk_ids: ``[num_tokens, num_topk]`` torch.int64 global expert ids; -1 = no selection.

    Returns:
        ``[num_tokens, ep_size]`` torch.bool; True where the rank holds >= 1 of the token's experts.
    """
    num_tokens = topk_ids.shape[0]
    # -1 slots go to an extra column that is dropped, so scatter only ever writes True.
    dest = torch.where(topk_ids >= 0, topk_ids // num_local_experts, ep_size)
    mask = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=topk_ids.device)
    mask.scatter_(1, dest, True)
    return mask[:, :ep_size]


def localize_topk(
    topk_ids: Tensor, topk_weights: Tensor, ep_rank: Tensor | int, *, num_local_experts: int
) -> tuple[Tensor, Tensor]:
    """Global expert ids → the local ids on ``ep_rank`` (-1 where the expert lives elsewhere).

    Args:
        topk_ids: ``[n, num_topk]`` torch.int64 global ids (-1 = no selection).
        topk_weights: ``[n, num_topk]`` torch.float32.
        ep_rank: the destination rank of every row: an int, or ``[n]`` torch.int64.

    Returns:
        ``(local_ids [n, num_topk] int64 in [0, num_local_experts) or -1,
        local_weights [n, num_topk] float32, 0 where local_ids == -1)``.
    """
    if isinstance(ep_rank, Tensor):
        ep_rank = ep_rank.unsqueeze(1)
    first_expert = ep_rank * num_local_experts
    is_local = (
        (topk_ids >= 0) & (topk_ids >= first_expert) & (topk_ids < first_expert + num_local_experts)
    )
    local_ids = torch.where(is_local, topk_ids - first_expert, -1)
    local_weights = torch.where(is_local, topk_weights, 0.0)
    return local_ids, local_weights
