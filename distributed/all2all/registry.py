"""The registry of expert all-to-all backends: ``--all2all-backend`` names to classes.

Global expert ``e`` lives on EP rank ``e // num_local_experts`` as local expert
``e % num_local_experts``. In the standard format (after DeepEP's high-throughput kernels, "per
destination rank, one row per token") a token whose top-k experts live on R distinct EP ranks is
sent once to each of those ranks; in the batched format once per (token, local expert).

Backends (activation format):
    ``all_to_all``               uneven ``all_to_all_single`` (AllToAllBackend; standard)
    ``allgather_reducescatter``  all-gather + reduce-scatter (AllGatherReduceScatterBackend; standard)
    ``deepep_high_throughput``   DeepEP's HT Buffer API (DeepEPHighThroughputBackend; standard)
    ``deepep_low_latency``       DeepEP's LL Buffer API, receive hooks (DeepEPLowLatencyBackend;
                                 batched: one row per (token, local expert), grouped per expert)
"""

from __future__ import annotations

from typing import Any

from distributed.all2all.all_to_all import AllToAllBackend
from distributed.all2all.allgather_reducescatter import AllGatherReduceScatterBackend
from distributed.all2all.base import All2AllBackend
from distributed.all2all.deepep_high_throughput import DeepEPHighThroughputBackend
from distributed.all2all.deepep_low_latency import DeepEPLowLatencyBackend

BACKENDS: dict[str, type[All2AllBackend]] = {
    cls.name: cls
    for cls in (
        AllToAllBackend,
        AllGatherReduceScatterBackend,
        DeepEPHighThroughputBackend,
        DeepEPLowLatencyBackend,
    )
}


def make_all2all_backend(name: str, **kwargs: Any) -> All2AllBackend:
    """Build the backend registered as ``name`` with ``All2AllBackend.__init__``'s kwargs plus
    any backend's ``extra_options``: an extra option goes only to the backends whose class
    declares it (``All2AllBackend.extra_options``), so one call site serves every backend.

    Raises:
        ValueError: if ``name`` is not one of ``BACKENDS`` (the message lists them), or the kwargs
            are invalid (see ``All2AllBackend``).
        TypeError: a kwarg that neither ``All2AllBackend`` nor any backend's ``extra_options``
            takes.
    """
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown all2all backend {name!r}; accepted: {sorted(BACKENDS)}"
        ) from None
    foreign = {opt for other in BACKENDS.values() for opt in other.extra_options}
    foreign -= set(cls.extra_options)
    return cls(**{k: v for k, v in kwargs.items() if k not in foreign})


__all__ = ["BACKENDS", "make_all2all_backend"]
