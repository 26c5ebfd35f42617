"""Attention metadata shared by every attention layer of one (u)batch (vLLM's
``CommonAttentionMetadata``), and its slicing into ubatches (``split_attn_metadata``).

The ubatch bounds (``UBatchSlice``) are DBO's (``dbo.ubatch_slicing``); what a bound means for the
attention inputs (rebased ``query_start_loc``, a cut request's ``seq_len``) is the metadata's, so it
lives here, on the model side. The model runner slices and hands each ubatch its slice through the
forward context (``dbo.forward_context``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from moe.platforms.device_probes import is_host

if TYPE_CHECKING:
    from dbo.ubatch_slicing import UBatchSlice

T = TypeVar("T")


def _check_tensor(name: str, tensor: Tensor, *, ndim: int, dtype: torch.dtype) -> None:
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim or tensor.dtype != dtype:
        raise ValueError(
            f"{name} must be a {ndim}-D {dtype} tensor, got shape {tuple(tensor.shape)} "
            f"dtype {tensor.dtype}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CommonAttentionMetadata:
    """Per-step attention inputs for a flat batch of requests (prefill chunks and decodes).

    Fields:
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths; starts at 0 and ends
            at ``num_actual_tokens``. Request ``r`` owns token rows
            ``query_start_loc[r] .. query_start_loc[r + 1] - 1``.
        seq_lens: ``[num_reqs]`` int32, context length of each request INCLUDING this step's query
            tokens, so the query positions of request ``r`` are ``seq_lens[r] - q_len ..
            seq_lens[r] - 1``.
        block_table: ``[num_reqs, max_num_blocks_per_req]`` int32, KV cache block ids.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``; -1 = padding (no
            KV write).
        num_reqs: number of requests.
        num_actual_tokens: real tokens, ``query_start_loc[-1]``.
        num_tokens: rows including padding (``>= num_actual_tokens``); rows past
            ``num_actual_tokens`` are padding tokens that belong to no request.
        max_query_len: ``max(query_start_loc[1:] - query_start_loc[:-1])`` (0 without requests).
        max_seq_len: ``max(seq_lens)`` (0 without requests).

    Derived values (``derived``): what every layer computes from this metadata alone (the batched
    attention's padding plan, the KV write slots) is built by the first layer and reused by the
    others, once per (u)batch: each ubatch has its own metadata object and so its own cache.

    Raises:
        ValueError: in ``__post_init__`` on a wrong shape or dtype, or (for CPU tensors, where
            checking costs no host-device sync) inconsistent values.
    """

    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    num_reqs: int
    num_actual_tokens: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    # key -> value built from the fields above (see ``derived``); not an init field, so every
    # metadata object, each ubatch's slice included, starts with an empty one
    _derived: dict[Hashable, Any] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def for_requests(
        cls, requests: Sequence[tuple[int, int]], block_size: int
    ) -> tuple[CommonAttentionMetadata, int]:
        """Metadata of ``requests`` (``(tokens already cached, query rows)`` each) over a cache
        where request r owns the consecutive blocks ``r * B .. r * B + B - 1`` (B the most any
        request needs), for benchmarks and measurements; returns it and the number of blocks the
        cache needs (``num_reqs * B``). No padding rows."""
        max_blocks = max(-(-(cached + rows) // block_size) for cached, rows in requests)
        block_table = torch.arange(len(requests) * max_blocks, dtype=torch.int32)
        block_table = block_table.view(-1, max_blocks)
        num_computed = torch.tensor([cached for cached, _ in requests])
        query_lens = torch.tensor([rows for _, rows in requests])
        seq_lens = num_computed + query_lens
        qsl = torch.cat((torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)))
        req = torch.repeat_interleave(torch.arange(len(requests)), query_lens)
        pos = torch.arange(int(qsl[-1])) - qsl[req] + num_computed[req]
        slots = block_table[req, pos // block_size].long() * block_size + pos % block_size
        metadata = cls(
            query_start_loc=qsl.int(),
            seq_lens=seq_lens.int(),
            block_table=block_table,
            slot_mapping=slots,
            num_reqs=len(requests),
            num_actual_tokens=int(qsl[-1]),
            num_tokens=int(qsl[-1]),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return metadata, len(requests) * max_blocks

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, computed once per metadata object and cached under ``key``.

        ``build`` must depend only on this metadata's fields and on what ``key`` names (e.g. the
        block size and device), so every layer of the step may share its result. The metadata's
        tensors must not be changed after the first call (the engine builds them per step).
        """
        try:
            return self._derived[key]
        except KeyError:
            value = self._derived[key] = build()
            return value

    def __post_init__(self) -> None:
        if self.num_reqs < 0:
            raise ValueError(f"num_reqs must be >= 0, got {self.num_reqs}")
        if not 0 <= self.num_actual_tokens <= self.num_tokens:
            raise ValueError(
                f"need 0 <= num_actual_tokens <= num_tokens, got num_actual_tokens="
                f"{self.num_actual_tokens}, num_tokens={self.num_tokens}"
            )
        _check_tensor("query_start_loc", self.query_start_loc, ndim=1, dtype=torch.int32)
        _check_tensor("seq_lens", self.seq_lens, ndim=1, dtype=torch.int32)
        _check_tensor("block_table", self.block_table, ndim=2, dtype=torch.int32)
        _check_tensor("slot_mapping", self.slot_mapping, ndim=1, dtype=torch.int64)
        shapes = {
            "query_start_loc": (self.query_start_loc.shape[0], self.num_reqs + 1),
            "seq_lens": (self.seq_lens.shape[0], self.num_reqs),
            "block_table": (self.block_table.shape[0], self.num_reqs),
            "slot_mapping": (self.slot_mapping.shape[0], self.num_tokens),
        }
        for name, (got, want) in shapes.items():
            if got != want:
                raise ValueError(f"{name} has {got} rows, expected {want}")
        if is_host(self.query_start_loc.device) and is_host(self.seq_lens.device):  # no device sync
            self._check_values()

    def _check_values(self) -> None:
        qsl = self.query_start_loc.tolist()
        seq_lens = self.seq_lens.tolist()
        if qsl[0] != 0 or qsl[-1] != self.num_actual_tokens:
            raise ValueError(
                f"query_start_loc must start at 0 and end at num_actual_tokens="
                f"{self.num_actual_tokens}, got {qsl}"
            )
        query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
        if any(q < 0 for q in query_lens):
            raise ValueError(f"query_start_loc must be non-decreasing, got {qsl}")
        if any(s < q for s, q in zip(seq_lens, query_lens, strict=True)):
            raise ValueError(
                f"every seq_len must be >= its query length, got seq_lens={seq_lens}, "
                f"query lengths={query_lens}"
            )
        max_query_len = max(query_lens, default=0)
        max_seq_len = max(seq_lens, default=0)
        if (self.max_query_len, self.max_seq_len) != (max_query_len, max_seq_len):
            raise ValueError(
                f"max_query_len/max_seq_len must be {max_query_len}/{max_seq_len}, got "
                f"{self.max_query_len}/{self.max_seq_len}"
            )

    @property
    def query_lens(self) -> Tensor:
        """``[num_reqs]`` int32 query length of each request."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


def _slice_metadata(
    ubatch_slice: UBatchSlice, common: CommonAttentionMetadata, qsl: list[int], seq_lens: list[int]
) -> CommonAttentionMetadata:
    req, tok = ubatch_slice.request_slice, ubatch_slice.token_slice
    # a request's rows clamped to the ubatch's rows: a cut first request starts at 0, a cut last
    # request ends at the ubatch's last real row
    new_qsl = [min(max(x, tok.start), tok.stop) - tok.start for x in qsl[req.start : req.stop + 1]]
    new_seq_lens = seq_lens[req]
    if new_seq_lens and qsl[req.stop] > tok.stop:
        # the last request continues in a later ubatch: its first part sees only its own tokens
        new_seq_lens[-1] -= qsl[req.stop] - tok.stop
    query_lens = [b - a for a, b in zip(new_qsl[:-1], new_qsl[1:], strict=True)]
    device = common.query_start_loc.device
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(new_qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(new_seq_lens, dtype=torch.int32, device=common.seq_lens.device),
        block_table=common.block_table[req],
        slot_mapping=common.slot_mapping[tok],
        num_reqs=len(new_seq_lens),
        num_actual_tokens=new_qsl[-1],
        num_tokens=ubatch_slice.num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(new_seq_lens, default=0),
    )


def split_attn_metadata(
    ubatch_slices: Sequence[UBatchSlice], common: CommonAttentionMetadata
) -> list[CommonAttentionMetadata]:
    """Slice ``common`` into one ``CommonAttentionMetadata`` per ubatch.

    ``query_start_loc`` is rebased to 0 in each slice; ``seq_lens`` and ``block_table`` rows are
    taken by ``request_slice``, ``slot_mapping`` by ``token_slice`` (``block_table`` and
    ``slot_mapping`` are views, not copies). A request cut between ubatches keeps its full
    ``seq_len`` in the ubatch that holds its last tokens; in an earlier ubatch its ``seq_len`` is
    reduced by the tokens that moved on, so its query positions stay the same.

    Raises:
        ValueError: if a slice's rows lie outside ``common`` or its ``request_slice`` does not
            match the requests of its ``token_slice``.
    """
    # host-device sync when the metadata lives on a GPU (once per step, before the ubatch threads)
    qsl = [int(x) for x in common.query_start_loc.tolist()]
    seq_lens = [int(x) for x in common.seq_lens.tolist()]
    result = []
    for k, ubatch_slice in enumerate(ubatch_slices):
        req, tok = ubatch_slice.request_slice, ubatch_slice.token_slice
        if tok.stop > common.num_tokens or req.stop > common.num_reqs:
            raise ValueError(
                f"ubatch {k} slice {ubatch_slice} exceeds the batch ({common.num_reqs} requests, "
                f"{common.num_tokens} token rows)"
            )
        real_start, real_stop = tok.start, min(tok.stop, common.num_actual_tokens)
        if req.start == req.stop:
            covers = real_stop <= real_start
        else:
            covers = (
                qsl[req.start] <= real_start < qsl[req.start + 1]
                and qsl[req.stop - 1] < real_stop <= qsl[req.stop]
            )
        if not covers:
            raise ValueError(
                f"ubatch {k}: request_slice {req} does not cover exactly the requests of "
                f"token_slice {tok} (query_start_loc={qsl})"
            )
        result.append(_slice_metadata(ubatch_slice, common, qsl, seq_lens))
    return result
