"""Attention metadata shared by every attention layer of one step (vLLM's CommonAttentionMetadata).

It lives in ``dbo/`` because cutting it into ubatches is DBO's job, and ``moe/`` may import ``dbo/``
but not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

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
        if self.query_start_loc.is_cpu and self.seq_lens.is_cpu:  # host values: no device sync
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
