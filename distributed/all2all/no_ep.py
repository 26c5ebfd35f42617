"""``no_ep``: without expert parallelism every expert is local, so dispatch and combine move
nothing and their handles come back completed."""

from __future__ import annotations

import datetime

from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all.base import (
    DispatchMetadata,
    DispatchRequest,
    DispatchResult,
    FusedMoEActivationFormat,
    FusedMoEPrepareAndFinalize,
    StandardDispatchMetadata,
)
from distributed.comm_handle import CommHandle, CompletedHandle


class NoEPPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """ep_size 1: global expert ids are the local ones; the tokens and the expert outputs pass
    through unchanged (``moves_tokens`` False; no host-synced id check even under
    ``MOE_DBO_DEBUG_CHECKS``: the experts check theirs).

    Raises:
        ValueError: ``num_experts < 1`` or ``ep_size != 1``.
    """

    name = "no_ep"
    activation_format = FusedMoEActivationFormat.Standard
    moves_tokens = False

    def __init__(
        self,
        *,
        num_experts: int,
        ep_group: ProcessGroup | None = None,
        ep_rank: int = 0,
        ep_size: int = 1,
        timeout: datetime.timedelta = datetime.timedelta(seconds=1),  # never waits
    ) -> None:
        if ep_size != 1:
            raise ValueError(f"no_ep serves ep_size 1 only, got ep_size={ep_size}")
        super().__init__(
            ep_group=None,
            ep_rank=0,
            ep_size=1,
            num_experts=num_experts,
            timeout=timeout,
            check_topk_ids=False,
        )

    def prepare(self, request: DispatchRequest) -> CommHandle[DispatchResult]:
        metadata = self._metadata(
            StandardDispatchMetadata, request, num_recv_tokens=request.num_tokens
        )
        return CompletedHandle(
            DispatchResult(
                hidden_states=request.hidden_states,
                topk_ids=request.topk_ids,
                topk_weights=request.topk_weights,
                metadata=metadata,
            )
        )

    def finalize(self, expert_output: Tensor, metadata: DispatchMetadata) -> CommHandle[Tensor]:
        return CompletedHandle(expert_output)
