"""Expert all-to-all backends, one module each, behind ``All2AllBackend`` (``base``) and the base
of the activation format each delivers (``StandardAll2AllBackend`` / ``BatchedAll2AllBackend``);
the registry maps ``--all2all-backend`` names to them. ``EmulatedLinkBackend`` (``emulated_link``)
puts any of them behind an emulated slower link."""

from distributed.all2all.all_to_all import AllToAllBackend, AllToAllDispatchMetadata
from distributed.all2all.allgather_reducescatter import (
    AllGatherDispatchMetadata,
    AllGatherReduceScatterBackend,
)
from distributed.all2all.base import (
    All2AllBackend,
    BatchedAll2AllBackend,
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DispatchMetadata,
    DispatchResult,
    FusedMoEActivationFormat,
    StandardAll2AllBackend,
    StandardDispatchMetadata,
)
from distributed.all2all.deepep_high_throughput import DeepEPHighThroughputBackend
from distributed.all2all.deepep_low_latency import DeepEPLowLatencyBackend
from distributed.all2all.emulated_link import EmulatedLinkBackend
from distributed.all2all.registry import BACKENDS, make_all2all_backend

__all__ = [
    "BACKENDS",
    "All2AllBackend",
    "AllGatherDispatchMetadata",
    "AllGatherReduceScatterBackend",
    "AllToAllBackend",
    "AllToAllDispatchMetadata",
    "BatchedAll2AllBackend",
    "BatchedDispatchMetadata",
    "BatchedDispatchResult",
    "DeepEPHighThroughputBackend",
    "DeepEPLowLatencyBackend",
    "DispatchMetadata",
    "DispatchResult",
    "EmulatedLinkBackend",
    "FusedMoEActivationFormat",
    "StandardAll2AllBackend",
    "StandardDispatchMetadata",
    "make_all2all_backend",
]
