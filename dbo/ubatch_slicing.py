"""Cut one step's flat batch into ubatches: the token and request bounds of each (the model side
slices its attention metadata to these bounds).

Follows vLLM's ``ubatch_utils`` / ``ubatch_splitting``, for N >= 2 ubatches: ubatch ``k`` starts at
row ``k * num_tokens_padded // N`` (for two, the cut is at ``num_tokens_padded // 2``, as in vLLM),
a prefill request may be cut in the middle, even across several ubatches, and padding rows go to
the last ubatch. A cut request is correct because ubatch ``k`` always runs layer L's attention (and
KV write) before ubatch ``k + 1`` does (the baton passes in ring order), so a continuation can
attend to the earlier parts through the KV cache with the request's full ``seq_len``.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


def _check_slice(name: str, value: slice) -> slice:
    """Validate ``value``; return it with plain-int bounds (numpy/tensor ints are accepted)."""
    if not isinstance(value, slice) or value.step not in (None, 1):
        raise ValueError(f"{name} must be a slice with step 1, got {value!r}")
    try:
        start, stop = operator.index(value.start), operator.index(value.stop)
    except TypeError:
        raise ValueError(f"{name} must have integer start and stop, got {value!r}") from None
    if not 0 <= start <= stop:
        raise ValueError(f"{name} needs 0 <= start <= stop, got {value!r}")
    return slice(start, stop)


@dataclass(frozen=True, slots=True, kw_only=True)
class UBatchSlice:
    """The part of a flat batch that one ubatch runs.

    Fields:
        request_slice: requests with at least one real token in this ubatch (indices into the
            step's requests, i.e. rows of ``seq_lens`` / ``block_table``).
        token_slice: ``[start, stop)`` token rows of this ubatch, padding rows included.
    """

    request_slice: slice
    token_slice: slice

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__ so equality and arithmetic see plain ints
        object.__setattr__(self, "request_slice", _check_slice("request_slice", self.request_slice))
        object.__setattr__(self, "token_slice", _check_slice("token_slice", self.token_slice))

    @property
    def num_tokens(self) -> int:
        """Token rows in this ubatch, padding included."""
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start


def _as_int_list(query_start_loc: Sequence[int] | Tensor) -> list[int]:
    if isinstance(query_start_loc, Tensor):
        # host-device sync when query_start_loc lives on a GPU (callers normally pass a CPU copy)
        return [int(x) for x in query_start_loc.tolist()]
    return [int(x) for x in query_start_loc]


def ubatch_bounds(num_tokens_padded: int, num_ubatches: int) -> list[int]:
    """``[num_ubatches + 1]`` row bounds: ubatch ``k`` has rows ``[bounds[k], bounds[k + 1])``,
    ``bounds[k] = k * num_tokens_padded // num_ubatches`` (ints, non-decreasing, last one
    ``num_tokens_padded``)."""
    return [k * num_tokens_padded // num_ubatches for k in range(num_ubatches)] + [
        num_tokens_padded
    ]


def max_num_ubatches(num_tokens_padded: int, min_num_tokens: int, num_ubatches: int) -> int:
    """The most ubatches, at most ``num_ubatches``, that every DP rank can run with a real token
    in each: ranks pad to ``num_tokens_padded`` rows, the fewest real tokens on a rank is
    ``min_num_tokens``. 1 (do not microbatch) if not even two can.

    Ubatch ``k`` of ``n`` has a real token on every rank iff it has a row and its first row is
    below ``min_num_tokens``: ``num_tokens_padded >= n`` and
    ``(n - 1) * num_tokens_padded // n < min_num_tokens``.
    """
    for n in range(num_ubatches, 1, -1):
        if num_tokens_padded >= n and (n - 1) * num_tokens_padded // n < min_num_tokens:
            return n
    return 1


def make_ubatch_slices(
    query_start_loc: Sequence[int] | Tensor, num_tokens_padded: int, num_ubatches: int = 2
) -> list[UBatchSlice]:
    """Cut ``num_tokens_padded`` token rows into ``num_ubatches`` contiguous ubatches.

    Args:
        query_start_loc: ``[num_reqs + 1]`` cumulative query lengths (ints or an int tensor),
            starting at 0; its last entry is the number of real tokens.
        num_tokens_padded: rows after padding (``>= query_start_loc[-1]``); rows past the real
            tokens are padding and go to the last ubatch.
        num_ubatches: ``>= 1``; ubatch ``k`` starts at row ``k * num_tokens_padded // num_ubatches``
            (``ubatch_bounds``; for two ubatches the split point is ``num_tokens_padded // 2``).

    Returns:
        One ``UBatchSlice`` per ubatch, in order; a request cut by a split point appears in both.

    Raises:
        ValueError: on a malformed ``query_start_loc``, ``num_tokens_padded`` below the real token
            count, ``num_ubatches < 1``, or if a ubatch would have no real token.
    """
    qsl = _as_int_list(query_start_loc)
    if not qsl or qsl[0] != 0 or any(b < a for a, b in zip(qsl[:-1], qsl[1:], strict=True)):
        raise ValueError(f"query_start_loc must start at 0 and be non-decreasing, got {qsl}")
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    num_actual_tokens = qsl[-1]
    if num_tokens_padded < num_actual_tokens:
        raise ValueError(
            f"num_tokens_padded={num_tokens_padded} must be >= the real token count "
            f"{num_actual_tokens}"
        )
    bounds = ubatch_bounds(num_tokens_padded, num_ubatches)
    slices = []
    for k in range(num_ubatches):
        start, stop = bounds[k], bounds[k + 1]
        real_stop = min(stop, num_actual_tokens)
        if real_stop <= start:
            raise ValueError(
                f"ubatch {k} of {num_ubatches} (token rows [{start}, {stop})) would have no real "
                f"token: {num_actual_tokens} real tokens padded to {num_tokens_padded}"
            )
        # bisect_right - 1: the request r with qsl[r] <= token < qsl[r + 1] (skips empty requests)
        first_req = bisect.bisect_right(qsl, start) - 1
        last_req = bisect.bisect_right(qsl, real_stop - 1) - 1
        slices.append(
            UBatchSlice(
                request_slice=slice(first_req, last_req + 1), token_slice=slice(start, stop)
            )
        )
    return slices
