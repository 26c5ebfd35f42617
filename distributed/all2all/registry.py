"""Expert all-to-all backends (dispatch / combine) and their registry.

Token layout, after DeepEP's high-throughput kernels ("per destination rank, one row per token"):
a token whose top-k experts live on R distinct EP ranks is sent once to each of those ranks.
Global expert ``e`` lives on EP rank ``e // num_local_experts`` as local expert
``e % num_local_experts``.

Backends:
    ``all_to_all``               uneven ``all_to_all_single`` (AllToAllBackend)
    ``allgather_reducescatter``  all-gather + reduce-scatter (AllGatherReduceScatterBackend)
"""

from __future__ import annotations

from typing import Any

from distributed.all2all.all_to_all import AllToAllBackend, AllToAllDispatchMetadata
from distributed.all2all.allgather_reducescatter import (
    AllGatherDispatchMetadata,
    AllGatherReduceScatterBackend,
)
from distributed.all2all.base import All2AllBackend, DispatchMetadata, DispatchResult
from distributed.comm_handle import CommHandle

BACKENDS: dict[str, type[All2AllBackend]] = {
    AllToAllBackend.name: AllToAllBackend,
    AllGatherReduceScatterBackend.name: AllGatherReduceScatterBackend,
}


def make_all2all_backend(name: str, **kwargs: Any) -> All2AllBackend:
    """Build the backend registered as ``name`` with ``All2AllBackend.__init__``'s kwargs.

    Raises:
        ValueError: if ``name`` is not one of ``BACKENDS`` (the message lists them), or the kwargs
            are invalid (see ``All2AllBackend``).
    """
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown all2all backend {name!r}; accepted: {sorted(BACKENDS)}"
        ) from None
    return cls(**kwargs)


__all__ = [
    "BACKENDS",
    "All2AllBackend",
    "AllGatherDispatchMetadata",
    "AllGatherReduceScatterBackend",
    "AllToAllBackend",
    "AllToAllDispatchMetadata",
    "CommHandle",
    "DispatchMetadata",
    "DispatchResult",
    "make_all2all_backend",
]
