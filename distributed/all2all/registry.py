"""Expert all-to-all backends (dispatch / combine) and their registry.

Token layout, after DeepEP's high-throughput kernels ("per destination rank, one row per token"):
a token whose top-k experts live on R distinct EP ranks is sent once to each of those ranks.
Global expert ``e`` lives on EP rank ``e // num_local_experts`` as local expert
``e % num_local_experts``.

Backends:
    ``all_to_all``               uneven ``all_to_all_single`` (AllToAllBackend)
    ``allgather_reducescatter``  all-gather + reduce-scatter (AllGatherReduceScatterBackend)
    ``deepep_high_throughput``   DeepEP's HT Buffer API (DeepEPHighThroughputBackend)
    ``deepep_low_latency``       DeepEP's LL Buffer API, receive hooks (DeepEPLowLatencyBackend)
"""

from __future__ import annotations

from typing import Any

from distributed.all2all.all_to_all import AllToAllBackend, AllToAllDispatchMetadata
from distributed.all2all.allgather_reducescatter import (
    AllGatherDispatchMetadata,
    AllGatherReduceScatterBackend,
)
from distributed.all2all.base import (
    All2AllBackend,
    BatchedDispatchResult,
    DispatchMetadata,
    DispatchResult,
)
from distributed.all2all.deepep_high_throughput import DeepEPHighThroughputBackend
from distributed.all2all.deepep_low_latency import DeepEPLowLatencyBackend
from distributed.comm_handle import CommHandle

BACKENDS: dict[str, type[All2AllBackend]] = {
    AllToAllBackend.name: AllToAllBackend,
    AllGatherReduceScatterBackend.name: AllGatherReduceScatterBackend,
    DeepEPHighThroughputBackend.name: DeepEPHighThroughputBackend,
    DeepEPLowLatencyBackend.name: DeepEPLowLatencyBackend,
}
# Extra constructor arguments only the DeepEP backends take (sizes of DeepEP's buffers).
DEEPEP_OPTIONS = ("hidden_size", "num_max_dispatch_tokens_per_rank")


def make_all2all_backend(name: str, **kwargs: Any) -> All2AllBackend:
    """Build the backend registered as ``name`` with ``All2AllBackend.__init__``'s kwargs; the
    DeepEP options (``DEEPEP_OPTIONS``) are passed only to the backends that take them.

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
    if not issubclass(cls, DeepEPHighThroughputBackend):
        kwargs = {k: v for k, v in kwargs.items() if k not in DEEPEP_OPTIONS}
    return cls(**kwargs)


__all__ = [
    "BACKENDS",
    "DEEPEP_OPTIONS",
    "All2AllBackend",
    "AllGatherDispatchMetadata",
    "AllGatherReduceScatterBackend",
    "AllToAllBackend",
    "AllToAllDispatchMetadata",
    "BatchedDispatchResult",
    "CommHandle",
    "DeepEPHighThroughputBackend",
    "DeepEPLowLatencyBackend",
    "DispatchMetadata",
    "DispatchResult",
    "make_all2all_backend",
]
