"""distributed: process groups from the torchrun environment and the expert all-to-all.

Imports only torch (and the standard library). Nothing happens at import time.
"""

from distributed.all2all import (
    BACKENDS,
    AllGatherReduceScatterPrepareAndFinalize,
    AllToAllPrepareAndFinalize,
    BatchedDispatchMetadata,
    BatchedDispatchResult,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DispatchMetadata,
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    NoEPPrepareAndFinalize,
    StandardDispatchMetadata,
    debug_checks_enabled,
    make_prepare_finalize,
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
    "AllGatherReduceScatterPrepareAndFinalize",
    "AllToAllPrepareAndFinalize",
    "BatchedDispatchMetadata",
    "BatchedDispatchResult",
    "CollectiveHandle",
    "CommHandle",
    "CommTiming",
    "CompletedHandle",
    "DeepEPHTPrepareAndFinalize",
    "DeepEPLLPrepareAndFinalize",
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
    "debug_checks_enabled",
    "destroy_distributed",
    "init_distributed",
    "init_parallel_groups",
    "make_prepare_finalize",
    "single_process_groups",
]
