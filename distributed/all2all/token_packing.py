"""Routing index math and the packed row of a ``Standard`` dispatch (DeepEP high-throughput's
``get_dispatch_layout`` / ``dispatch``): a token goes once to every EP rank holding one of its
top-k experts, its ``topk_ids``, ``topk_weights`` and hidden state packed into one uint8 row, so
a dispatch moves ONE payload tensor. The row's layout:
docs/backends.md#token-packing-one-payload-row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Sent with the counts, so that ranks disagreeing on the row format fail with a clear error
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
    """Byte offsets of a packed row's fields; ValueError for a dtype outside ``DTYPE_CODES`` or
    ``hidden_size`` / ``num_topk`` below 1."""

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

    def check_signatures(self, signatures: list[list[int]], op: str, rank: int) -> None:
        """ValueError (raised on every rank, before the payload) unless every EP rank's
        ``signature()`` in ``signatures`` equals this one."""
        if any(sig != list(self.signature()) for sig in signatures):
            raise ValueError(
                f"{op} on ep_rank {rank}: (hidden_size, num_topk, dtype code) differ across EP "
                f"ranks: {signatures}; every rank must dispatch the same hidden_size, num_topk "
                f"and dtype"
            )


def pack_rows(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    layout: RowLayout,
    *,
    num_rows: int | None = None,
) -> Tensor:
    """``[num_rows (default n), row_bytes]`` uint8 of ``hidden_states [n, hidden_size]``
    (``layout.dtype``), ``topk_ids [n, num_topk]`` int64 and float32 ``topk_weights``; zero
    padding."""
    n = hidden_states.shape[0]
    num_rows = n if num_rows is None else num_rows
    packed = torch.zeros(num_rows, layout.row_bytes, dtype=torch.uint8, device=hidden_states.device)
    ids, weights, hidden = unpack_rows(packed[:n], layout)
    ids.copy_(topk_ids)
    weights.copy_(topk_weights)
    hidden.copy_(hidden_states)
    return packed


def unpack_rows(packed: Tensor, layout: RowLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-copy views ``(topk_ids [n, num_topk] int64, topk_weights float32, hidden_states
    [n, hidden_size])`` of ``packed [n, row_bytes]`` uint8 (ValueError for another shape)."""
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
    """``[num_tokens, ep_size]`` torch.bool, True where the rank holds >= 1 of the token's
    experts (DeepEP's ``is_token_in_rank``), of ``topk_ids [num_tokens, num_topk]`` int64 global
    ids (-1 = no selection)."""
    num_tokens = topk_ids.shape[0]
    # -1 slots go to an extra column that is dropped, so scatter only ever writes True.
    dest = torch.where(topk_ids >= 0, topk_ids // num_local_experts, ep_size)
    mask = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=topk_ids.device)
    mask.scatter_(1, dest, True)
    return mask[:, :ep_size]


def localize_topk(
    topk_ids: Tensor, topk_weights: Tensor, ep_rank: Tensor | int, *, num_local_experts: int
) -> tuple[Tensor, Tensor]:
    """Global expert ids ``[n, num_topk]`` → the local ids on ``ep_rank`` (an int, or ``[n]``
    int64 per row), -1 where the expert lives elsewhere; the float32 weights, 0 there."""
    if isinstance(ep_rank, Tensor):
        ep_rank = ep_rank.unsqueeze(1)
    first_expert = ep_rank * num_local_experts
    is_local = (topk_ids >= first_expert) & (topk_ids < first_expert + num_local_experts)
    local_ids = torch.where(is_local, topk_ids - first_expert, -1)
    local_weights = torch.where(is_local, topk_weights, 0.0)
    return local_ids, local_weights


def pack_sent_rows(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    layout: RowLayout,
    *,
    num_local_experts: int,
    ep_size: int,
    is_token_in_rank: Tensor | None = None,
    block: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The rows a rank sends: each (destination rank, token) pair of ``is_token_in_rank``
    (``[num_tokens, ep_size]`` bool; None: ``token_rank_mask`` of ``topk_ids``), sorted by rank
    then token, with the token's top-k ids made local to the destination (``localize_topk``).
    Host tensors are packed by our compiled CPU kernel in one call (``moe.kernels``, where built;
    the torch ops below, which run elsewhere, are its reference: the same bytes).

    Args:
        block: None: the rows back to back. Else rank r's rows start at row ``r * block + 1`` of
            ``[ep_size * block, row_bytes]`` zeros (row ``r * block`` is left for the caller's
            header), ``block >= 1 + num_tokens``.

    Returns:
        ``(packed [num_pairs or ep_size * block, row_bytes] uint8, send_counts [ep_size] int64
        (rows for each rank), send_token_idx [num_pairs] int64)``.

    Raises:
        ValueError: a ``block`` without room; (kernel) an expert id past the experts.
    """
    num_tokens = topk_ids.shape[0]
    if block is not None and block < 1 + num_tokens:
        raise ValueError(
            f"block must hold a header row and every token: got {block} for {num_tokens} tokens"
        )
    kernel = _packing_kernel(hidden_states)
    if kernel is not None:
        offsets = (layout.weights_offset, layout.hidden_offset, layout.row_bytes)
        ids, weights = topk_ids.contiguous(), topk_weights.float().contiguous()
        args = (is_token_in_rank, ep_size, num_local_experts, *offsets, block or 0)
        return kernel(hidden_states.contiguous(), ids, weights, *args)
    if is_token_in_rank is None:
        is_token_in_rank = token_rank_mask(
            topk_ids, num_local_experts=num_local_experts, ep_size=ep_size
        )
    # nonzero of the transposed mask lists (rank, token) pairs sorted by rank, then token
    send_rank, send_token_idx = is_token_in_rank.t().nonzero(as_tuple=True)
    local_ids, local_weights = localize_topk(
        topk_ids[send_token_idx],
        topk_weights[send_token_idx].float(),
        send_rank,
        num_local_experts=num_local_experts,
    )
    packed = pack_rows(hidden_states[send_token_idx], local_ids, local_weights, layout)
    send_counts = is_token_in_rank.sum(dim=0)
    if block is not None:
        packed = _into_blocks(packed, send_rank, send_counts, block)
    return packed, send_counts, send_token_idx


def _into_blocks(packed: Tensor, send_rank: Tensor, send_counts: Tensor, block: int) -> Tensor:
    """``pack_sent_rows``' padded layout of its back-to-back rows (``send_rank``: each row's)."""
    # a pair's row: its rank's block, after the header, at its index among the rank's pairs
    device, ep_size = packed.device, send_counts.shape[0]
    first_of_rank = torch.cumsum(send_counts, 0) - send_counts
    pair = torch.arange(send_rank.shape[0], device=device)
    rows = send_rank * block + 1 + pair - first_of_rank[send_rank]
    padded = torch.zeros(ep_size * block, packed.shape[1], dtype=torch.uint8, device=device)
    padded.index_copy_(0, rows, packed)
    return padded


def unpack_row_ranges(
    packed: Tensor, layout: RowLayout, ranges: Sequence[tuple[int, int]]
) -> tuple[Tensor, Tensor, Tensor]:
    """The rows ``[first, first + n)`` of each ``(first, n)`` of ``ranges``, in order, of
    ``packed [num_rows, row_bytes]`` uint8, as contiguous ``(topk_ids [m, num_topk] int64,
    topk_weights float32, hidden_states [m, hidden_size] layout.dtype)``: ``unpack_rows`` of those
    rows, copied out. Our compiled CPU kernel copies each field once (``moe.kernels``, where
    built).

    Raises:
        ValueError: a range outside ``packed``'s rows.
    """
    for first, n in ranges:
        if first < 0 or n < 0 or first + n > packed.shape[0]:
            raise ValueError(f"rows [{first}, {first + n}) lie outside the {packed.shape[0]} rows")
    kernel = _unpacking_kernel(packed)
    if kernel is None:
        if len(ranges) == 1:  # one range: a view, the fields' copies are the only ones
            rows = packed[ranges[0][0] : ranges[0][0] + ranges[0][1]]
        else:
            device = packed.device
            idx = [torch.arange(first, first + n, device=device) for first, n in ranges]
            rows = packed[torch.cat(idx)] if idx else packed[:0]
        return tuple(t.contiguous() for t in unpack_rows(rows, layout))  # type: ignore[return-value]
    if packed.dim() != 2 or packed.shape[1] != layout.row_bytes or packed.dtype != torch.uint8:
        unpack_rows(packed, layout)  # raises its ValueError
    ids, weights, hidden = kernel(
        packed.contiguous(),
        [first for first, _ in ranges],
        [n for _, n in ranges],
        layout.num_topk,
        layout.weights_offset,
        layout.hidden_offset,
        layout.hidden_bytes,
    )
    return ids, weights, hidden.view(layout.dtype)


def _host_kernels(t: Tensor):
    """``moe.kernels.host.host_kernels(t)``: our compiled CPU kernels for a host tensor outside a
    trace, else None (the torch paths run)."""
    from moe.kernels.host import host_kernels  # imported here: moe imports this package

    return host_kernels(t)


def _unpacking_kernel(packed: Tensor):
    """Our compiled ``unpack_row_ranges`` where ``_host_kernels`` has it, else None."""
    kernels = _host_kernels(packed)
    return None if kernels is None else kernels.unpack_row_ranges


def _packing_kernel(hidden_states: Tensor):
    """Our compiled ``pack_sent_rows`` where ``_host_kernels`` has it, else None."""
    kernels = _host_kernels(hidden_states)
    return None if kernels is None else kernels.pack_sent_rows
