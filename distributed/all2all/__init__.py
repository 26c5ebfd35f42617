"""Expert all-to-all: one ``FusedMoEPrepareAndFinalize`` subclass per communication pattern, one
module each, and their registry, one line per class: ``no_ep`` serves ep_size 1; the others are
the ``--all2all-backend`` choices (``BACKENDS``)."""

from __future__ import annotations

from typing import Any

from distributed.all2all.all_to_all import AllToAllPrepareAndFinalize
from distributed.all2all.allgather_reducescatter import AllGatherReduceScatterPrepareAndFinalize
from distributed.all2all.base import (
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DispatchMetadata,
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    StandardDispatchMetadata,
    debug_checks_enabled,
)
from distributed.all2all.deepep_high_throughput import DeepEPHTPrepareAndFinalize
from distributed.all2all.deepep_low_latency import DeepEPLLPrepareAndFinalize
from distributed.all2all.no_ep import NoEPPrepareAndFinalize

PATTERNS: tuple[type[FusedMoEPrepareAndFinalize], ...] = (
    NoEPPrepareAndFinalize,
    AllToAllPrepareAndFinalize,
    AllGatherReduceScatterPrepareAndFinalize,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
BACKENDS: dict[str, type[FusedMoEPrepareAndFinalize]] = {
    cls.name: cls for cls in PATTERNS if cls.moves_tokens
}


def make_prepare_finalize(name: str, **kwargs: Any) -> FusedMoEPrepareAndFinalize:
    """The pattern registered as ``name``, built with the base class's kwargs plus the
    ``extra_options`` of any pattern: an extra option goes only to the classes that declare it,
    so one call site serves them all.

    Raises:
        ValueError: an unknown ``name`` (the message lists ``BACKENDS``) or invalid kwargs.
        TypeError: a kwarg that neither the base class nor any pattern's ``extra_options`` takes.
    """
    registry = {cls.name: cls for cls in PATTERNS} | BACKENDS
    if name not in registry:
        raise ValueError(f"unknown all2all backend {name!r}; accepted: {sorted(BACKENDS)}")
    cls = registry[name]
    foreign = {opt for other in registry.values() for opt in other.extra_options}
    foreign -= set(cls.extra_options)
    return cls(**{k: v for k, v in kwargs.items() if k not in foreign})


__all__ = [
    "BACKENDS",
    "PATTERNS",
    "AllGatherReduceScatterPrepareAndFinalize",
    "AllToAllPrepareAndFinalize",
    "BatchedDispatchMetadata",
    "BatchedDispatchResult",
    "DeepEPHTPrepareAndFinalize",
    "DeepEPLLPrepareAndFinalize",
    "DispatchMetadata",
    "DispatchRequest",
    "DispatchResult",
    "FusedMoEActivationFormat",
    "FusedMoEPrepareAndFinalize",
    "NoEPPrepareAndFinalize",
    "StandardDispatchMetadata",
    "debug_checks_enabled",
    "make_prepare_finalize",
]
