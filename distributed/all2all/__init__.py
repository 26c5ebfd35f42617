"""Expert all-to-all: one ``FusedMoEPrepareAndFinalize`` subclass per communication pattern, one
module each, named in ``registry``."""

from distributed.all2all.all_to_all import AllToAllBackend
from distributed.all2all.allgather_reducescatter import AllGatherReduceScatterBackend
from distributed.all2all.base import (
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DispatchMetadata,
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    StandardDispatchMetadata,
)
from distributed.all2all.deepep_high_throughput import DeepEPHighThroughputBackend
from distributed.all2all.deepep_low_latency import DeepEPLowLatencyBackend
from distributed.all2all.no_ep import NoEPPrepareAndFinalize
from distributed.all2all.registry import BACKENDS, PATTERNS, make_all2all_backend

__all__ = [
    "BACKENDS",
    "PATTERNS",
    "AllGatherReduceScatterBackend",
    "AllToAllBackend",
    "BatchedDispatchMetadata",
    "BatchedDispatchResult",
    "DeepEPHighThroughputBackend",
    "DeepEPLowLatencyBackend",
    "DispatchMetadata",
    "DispatchRequest",
    "DispatchResult",
    "FusedMoEActivationFormat",
    "FusedMoEPrepareAndFinalize",
    "NoEPPrepareAndFinalize",
    "StandardDispatchMetadata",
    "make_all2all_backend",
]
