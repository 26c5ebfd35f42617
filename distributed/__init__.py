"""distributed: process groups from the torchrun environment and the expert all-to-all backends.

Imports only torch (and the standard library). Nothing happens at import time.
"""

from distributed.all2all import (
    BACKENDS,
    All2AllBackend,
    AllGatherDispatchMetadata,
    AllGatherReduceScatterBackend,
    AllToAllBackend,
    AllToAllDispatchMetadata,
    BatchedAll2AllBackend,
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DeepEPHighThroughputBackend,
    DeepEPLowLatencyBackend,
    DispatchMetadata,
    DispatchResult,
    FusedMoEActivationFormat,
    StandardAll2AllBackend,
    StandardDispatchMetadata,
    make_all2all_backend,
)
from distributed.all2all.emulated_link import EmulatedLinkBackend, LinkDelayedHandle
from distributed.comm_handle import CollectiveHandle, CommHandle, CommTiming, CompletedHandle
from distributed.link_emulation import EmulatedLink, LinkSpec
from distributed.parallel_state import (
    ParallelGroups,
    TorchrunEnv,
    destroy_distributed,
    init_distributed,
    single_process_groups,
)

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
    "CollectiveHandle",
    "CommHandle",
    "CommTiming",
    "CompletedHandle",
    "DeepEPHighThroughputBackend",
    "DeepEPLowLatencyBackend",
    "DispatchMetadata",
    "DispatchResult",
    "EmulatedLink",
    "EmulatedLinkBackend",
    "FusedMoEActivationFormat",
    "LinkDelayedHandle",
    "LinkSpec",
    "ParallelGroups",
    "StandardAll2AllBackend",
    "StandardDispatchMetadata",
    "TorchrunEnv",
    "destroy_distributed",
    "init_distributed",
    "make_all2all_backend",
    "single_process_groups",
]
