"""distributed: process groups from the torchrun environment and the expert all-to-all.

Imports only torch (and the standard library). Nothing happens at import time.
"""

from distributed.all2all import (
    BACKENDS,
    AllGatherReduceScatterBackend,
    AllToAllBackend,
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DeepEPHighThroughputBackend,
    DeepEPLowLatencyBackend,
    DispatchMetadata,
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    NoEPPrepareAndFinalize,
    StandardDispatchMetadata,
    make_all2all_backend,
)
from distributed.comm_handle import CollectiveHandle, CommHandle, CommTiming, CompletedHandle
from distributed.link_emulation import EmulatedLink, LinkDelayedHandle, LinkSpec
from distributed.parallel_state import (
    ParallelGroups,
    TorchrunEnv,
    destroy_distributed,
    init_distributed,
    init_parallel_groups,
    single_process_groups,
)

__all__ = [
    "BACKENDS",
    "AllGatherReduceScatterBackend",
    "AllToAllBackend",
    "BatchedDispatchMetadata",
    "BatchedDispatchResult",
    "CollectiveHandle",
    "CommHandle",
    "CommTiming",
    "CompletedHandle",
    "DeepEPHighThroughputBackend",
    "DeepEPLowLatencyBackend",
    "DispatchMetadata",
    "DispatchRequest",
    "DispatchResult",
    "EmulatedLink",
    "FusedMoEActivationFormat",
    "FusedMoEPrepareAndFinalize",
    "LinkDelayedHandle",
    "LinkSpec",
    "NoEPPrepareAndFinalize",
    "ParallelGroups",
    "StandardDispatchMetadata",
    "TorchrunEnv",
    "destroy_distributed",
    "init_distributed",
    "init_parallel_groups",
    "make_all2all_backend",
    "single_process_groups",
]
