"""Where one rank computes: its device and the process-group backend that fits it.

A platform answers ``place_rank`` with a ``RankPlacement``; the engine builds the model, the KV
cache and every step tensor on ``placement.device`` and its process groups on
``placement.dist_backend``. On CUDA, rank ``local_rank`` of a node gets ``cuda:{local_rank}``;
a node with fewer visible devices than ranks is refused unless sharing is asked for
(``--share-gpus``), and then ranks share devices round-robin and their groups run on gloo, whose
transfers are staged through host memory (``distributed.collectives``): NCCL refuses two ranks
on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARE_FLAG = "--share-gpus"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlacement:
    """One rank's device and process-group backend.

    Attributes:
        device: where parameters, KV cache and step tensors live.
        dist_backend: ``"gloo"`` or ``"nccl"``.
        num_ranks_on_device: ranks of this node computing on ``device`` (> 1: shared).
    """

    device: torch.device
    dist_backend: str
    num_ranks_on_device: int = 1

    @property
    def is_shared(self) -> bool:
        return self.num_ranks_on_device > 1


def host_placement() -> RankPlacement:
    """The host CPU over gloo: every rank of a node computes there."""
    return RankPlacement(device=torch.device("cpu"), dist_backend="gloo")


def accelerator_index(
    *, local_rank: int, local_world_size: int, device_count: int, share_devices: bool
) -> tuple[int, int]:
    """``(device index, ranks on that device)`` of rank ``local_rank`` among ``local_world_size``
    ranks of a node with ``device_count`` visible devices.

    Raises:
        ValueError: no device is visible; ``local_rank`` is outside ``[0, local_world_size)``;
            or fewer devices than ranks without ``share_devices`` (one line naming both counts
            and the flag).
    """
    if device_count < 1:
        raise ValueError("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK must be in [0, {local_world_size}), got {local_rank}")
    if local_world_size > device_count and not share_devices:
        raise ValueError(
            f"{local_world_size} ranks on this node but {device_count} CUDA device(s) visible: "
            f"start at most {device_count} rank(s) per node, or pass {SHARE_FLAG} to let ranks "
            "share devices (their all-to-all then runs over gloo through host memory)"
        )
    index = local_rank % device_count
    num_on_device = len(range(index, local_world_size, device_count))
    return index, num_on_device
