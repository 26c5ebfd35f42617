"""Process groups of one engine process, built from the torchrun environment.

Layout (tensor parallel = 1): every rank is one data-parallel (DP) attention rank; with expert
parallelism the expert-parallel (EP) group spans the same ranks, so ``ep_rank == dp_rank`` and
``ep_size == dp_size``. Without it each rank holds every expert and there is no EP group.

The DP group and the EP group are two separate ``new_group`` communicators, so the DP-wide
microbatching vote and the expert all-to-all never share a tag sequence (nor a NCCL stream).
Nothing here runs at import time; groups are returned, never stashed in module globals.
``init_parallel_groups`` places the rank where the platform it is given says (device, backend,
transport); this package imports no platform code.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from distributed.communicator import Communicator

_REQUIRED_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchrunEnv:
    """The rank layout torchrun hands to each process; ``local_world_size``: ranks on this node
    (torchrun's ``LOCAL_WORLD_SIZE``; None: unknown, taken as ``world_size``); ``node_rank``:
    this node (torchrun's ``GROUP_RANK``; None: unknown, taken as ``rank // num_local_ranks``);
    ``job_id``: names this job's shared resources (torchrun's run id and master port).

    Raises:
        ValueError: if ``world_size < 1``, ``rank`` is outside ``[0, world_size)``,
            ``local_rank < 0`` or ``local_rank >= local_world_size``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None
    node_rank: int | None = None
    job_id: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"LOCAL_RANK must be >= 0, got {self.local_rank}")
        if self.local_world_size is not None and self.local_rank >= self.local_world_size:
            raise ValueError(
                f"LOCAL_RANK must be < LOCAL_WORLD_SIZE ({self.local_world_size}), "
                f"got {self.local_rank}"
            )

    @property
    def num_local_ranks(self) -> int:
        """Ranks on this node (``LOCAL_WORLD_SIZE``, else the world size)."""
        return self.world_size if self.local_world_size is None else self.local_world_size

    @property
    def node(self) -> int:
        """This rank's node: ``GROUP_RANK``, else ``rank // num_local_ranks``."""
        return self.rank // self.num_local_ranks if self.node_rank is None else self.node_rank

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Parse ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; check ``MASTER_ADDR``/``MASTER_PORT``.

        Args:
            environ: the variables to read; ``os.environ`` (read now, at call time) when None.

        Raises:
            ValueError: naming every missing variable (run under ``torchrun``), or the variable
                whose value is not an integer / not a valid port / out of range.
        """
        environ = os.environ if environ is None else environ
        missing = [key for key in _REQUIRED_KEYS if not environ.get(key)]
        if missing:
            raise ValueError(
                f"missing torchrun environment variables {missing}; launch with torchrun "
                f"(required: {list(_REQUIRED_KEYS)})"
            )
        values = {key: _parse_int(environ, key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        port = _parse_int(environ, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT must be in [1, 65535], got {port}")
        local_world_size = node_rank = None
        if environ.get("LOCAL_WORLD_SIZE"):
            local_world_size = _parse_int(environ, "LOCAL_WORLD_SIZE")
        if environ.get("GROUP_RANK"):
            node_rank = _parse_int(environ, "GROUP_RANK")
        return cls(
            rank=values["RANK"],
            world_size=values["WORLD_SIZE"],
            local_rank=values["LOCAL_RANK"],
            local_world_size=local_world_size,
            node_rank=node_rank,
            job_id=f"{environ.get('TORCHELASTIC_RUN_ID', 'none')}-{port}",
        )


def _parse_int(environ: Mapping[str, str], key: str) -> int:
    raw = environ[key]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {raw!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    """Ranks and process groups of this process (TP = 1, DP attention, optional EP).

    ``ep_group`` is None exactly when ``ep_size == 1``; ``dp_group`` is None only for a process
    without torch.distributed (``single_process_groups``: one DP rank, no collectives).
    ``timeout`` is the limit applied to every collective and every blocking wait on these groups.
    ``dp_rank_of_ep_rank`` (``[ep_size]``) names the DP rank whose tokens each EP rank dispatches,
    so DP token counts map to EP counts without assuming ``ep_size == dp_size``; None when the
    layout is not known (the all-to-all then exchanges its counts). ``num_ranks_on_device``: the
    ranks of this node computing on ``device`` (> 1: shared, ``RankPlacement``'s).
    ``dp_comm`` and ``ep_comm``
    run the collectives of ``dp_group`` and ``ep_group`` (``distributed.communicator``: gloo,
    NCCL, or shared memory within a node); None exactly when their group is None (left out:
    torch.distributed's over the group).
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_group: ProcessGroup | None
    ep_rank: int
    ep_size: int
    ep_group: ProcessGroup | None
    device: torch.device
    timeout: datetime.timedelta
    dp_rank_of_ep_rank: tuple[int, ...] | None = None
    num_ranks_on_device: int = 1
    dp_comm: Communicator | None = None
    ep_comm: Communicator | None = None

    def __post_init__(self) -> None:
        if self.num_ranks_on_device < 1:
            raise ValueError(f"num_ranks_on_device must be >= 1, got {self.num_ranks_on_device}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank must be in [0, {self.ep_size}), got {self.ep_rank}")
        if (self.ep_group is None) != (self.ep_size == 1):
            raise ValueError(
                f"ep_group must be None exactly when ep_size == 1, got ep_size={self.ep_size}, "
                f"ep_group={self.ep_group!r}"
            )
        if self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout}")
        for name in ("dp", "ep"):
            group, comm = getattr(self, f"{name}_group"), getattr(self, f"{name}_comm")
            if comm is None and group is not None:
                object.__setattr__(self, f"{name}_comm", Communicator(group))
            elif comm is not None and comm.group is not group:
                raise ValueError(f"{name}_comm must run {name}_group's collectives, got {comm!r}")
        ranks = self.dp_rank_of_ep_rank
        if ranks is not None and (
            len(ranks) != self.ep_size
            or not all(0 <= r < self.dp_size for r in ranks)
            or ranks[self.ep_rank] != self.dp_rank
        ):
            raise ValueError(
                f"dp_rank_of_ep_rank must list {self.ep_size} DP ranks in [0, {self.dp_size}) "
                f"with entry {self.ep_rank} = dp_rank {self.dp_rank}, got {ranks}"
            )


def _check_layout(data_parallel_size: int, env: TorchrunEnv, timeout_s: float) -> None:
    """ValueError unless one DP rank runs per process and ``timeout_s > 0``."""
    if data_parallel_size != env.world_size:
        raise ValueError(
            f"data_parallel_size ({data_parallel_size}) must equal the world size "
            f"({env.world_size}): one DP attention rank per process (tensor parallel = 1)"
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")


def init_distributed(
    *,
    data_parallel_size: int,
    enable_expert_parallel: bool,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    device: torch.device | None = None,
    env: TorchrunEnv | None = None,
    num_ranks_on_device: int = 1,
    make_communicator: Callable[[ProcessGroup], Communicator] | None = None,
) -> ParallelGroups:
    """Initialise the default process group (if needed) and build the DP and EP groups.

    Collective: every rank must call it with the same arguments (``new_group`` is collective).

    Args:
        data_parallel_size: number of DP attention ranks; must equal the world size (TP = 1).
        enable_expert_parallel: shard experts over all DP ranks (``ep_size = dp_size``); otherwise
            every rank holds every expert (``ep_size = 1``, ``ep_group = None``).
        timeout_s: limit in seconds for every collective on these groups.
        backend: ``"gloo"`` or ``"nccl"`` (the platform's ``RankPlacement.dist_backend``).
        device: where this rank computes (the platform's ``RankPlacement.device``; default cpu).
            An NCCL group needs it to be this rank's CUDA device.
        env: the rank layout; parsed from ``os.environ`` when None.
        num_ranks_on_device: ranks of this node on ``device`` (``RankPlacement``'s; >= 1).
        make_communicator: builds each group's communicator, collectively (the platform's
            ``make_communicator``: shared memory within a node); None: torch.distributed's.

    Raises:
        ValueError: if ``data_parallel_size != world_size``, ``timeout_s <= 0``, the backend is
            unknown or nccl is asked for without CUDA, or the torchrun environment is bad.
        RuntimeError: if a default group already exists with a different rank / world size.
    """
    env = TorchrunEnv.from_environ() if env is None else env
    _check_layout(data_parallel_size, env, timeout_s)
    _check_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu") if device is None else torch.device(device)
    _init_default_group(env, backend, timeout)
    return _new_groups(
        env,
        ep_size=env.world_size if enable_expert_parallel else 1,
        backend=backend,
        device=device,
        timeout=timeout,
        num_ranks_on_device=num_ranks_on_device,
        make_communicator=make_communicator or Communicator,
    )


def _new_groups(
    env: TorchrunEnv,
    *,
    ep_size: int,
    backend: str,
    device: torch.device,
    timeout: datetime.timedelta,
    num_ranks_on_device: int,
    make_communicator: Callable[[ProcessGroup], Communicator],
) -> ParallelGroups:
    """The DP group, the EP group when ``ep_size > 1``, and their communicators (collective)."""
    all_ranks = list(range(env.world_size))
    # Two separate communicators: DP-wide votes and expert all-to-alls never interleave on one tag
    # sequence, even when two ubatch threads issue them.
    dp_group = dist.new_group(all_ranks, timeout=timeout, backend=backend)
    ep_group = None
    if ep_size > 1:
        ep_group = dist.new_group(all_ranks, timeout=timeout, backend=backend)
    dp_comm = make_communicator(dp_group)
    ep_comm = None if ep_group is None else make_communicator(ep_group)
    return ParallelGroups(
        rank=env.rank,
        world_size=env.world_size,
        dp_rank=env.rank,
        dp_size=env.world_size,
        dp_group=dp_group,
        ep_rank=env.rank if ep_size > 1 else 0,
        ep_size=ep_size,
        ep_group=ep_group,
        device=device,
        timeout=timeout,
        # the EP group spans the DP ranks in order (TP = 1); without EP the one EP rank is this one
        dp_rank_of_ep_rank=tuple(all_ranks) if ep_size > 1 else (env.rank,),
        num_ranks_on_device=num_ranks_on_device,
        dp_comm=dp_comm,
        ep_comm=ep_comm,
    )


def init_parallel_groups(
    platform,
    *,
    data_parallel_size: int,
    enable_expert_parallel: bool,
    timeout_s: float,
    share_devices: bool = False,
) -> ParallelGroups:
    """This rank's groups (``init_distributed``) on the device and process-group backend
    ``platform`` (``moe.platforms.Platform``: its ``place_rank`` and ``make_communicator``)
    places this rank on, from the torchrun environment. Collective: every rank calls it.
    ``share_devices``: more ranks on the node than devices may share them (``--share-gpus``).

    Raises:
        ValueError: before any process group exists, if the platform cannot place this rank
            (e.g. more ranks on the node than GPUs without ``share_devices``) or the torchrun
            environment is bad; as ``init_distributed`` raises.
    """
    env = TorchrunEnv.from_environ()
    placement = platform.place_rank(
        local_rank=env.local_rank,
        local_world_size=env.num_local_ranks,
        share_devices=share_devices,
    )
    if placement.is_shared and env.rank == 0:
        print(
            f"moe-dbo: {placement.num_ranks_on_device} ranks share {placement.device}: process "
            "groups on gloo, transfers staged through host memory",
            file=sys.stderr,
            flush=True,
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    return init_distributed(
        data_parallel_size=data_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        timeout_s=timeout_s,
        backend=placement.dist_backend,
        device=placement.device,
        env=env,
        num_ranks_on_device=placement.num_ranks_on_device,
        # the platform's transport: shared memory between the ranks of a node on the CPU
        make_communicator=functools.partial(platform.make_communicator, env=env, timeout=timeout),
    )


def single_process_groups(
    timeout_s: float = 300.0, device: torch.device | None = None
) -> ParallelGroups:
    """The groups of a process that runs alone without torchrun: one DP rank, no expert
    parallelism, no process group at all (nothing to agree on, so no collective ever runs).
    ``device``: the platform's (default cpu).

    Raises:
        ValueError: if ``timeout_s <= 0``.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    device = torch.device("cpu") if device is None else device
    return ParallelGroups(
        rank=0,
        world_size=1,
        dp_rank=0,
        dp_size=1,
        dp_group=None,
        ep_rank=0,
        ep_size=1,
        ep_group=None,
        device=device,
        timeout=datetime.timedelta(seconds=timeout_s),
        dp_rank_of_ep_rank=(0,),
    )


def _init_default_group(env: TorchrunEnv, backend: str, timeout: datetime.timedelta) -> None:
    """Create the default process group, or check that the existing one is this rank's.

    Raises:
        RuntimeError: if a default group already exists with a different rank / world size.
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise RuntimeError(
                f"a default process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {env.rank} of "
                f"{env.world_size}; call destroy_distributed() first"
            )
        return
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def _check_backend(backend: str) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")


def destroy_distributed() -> None:
    """Destroy every process group of this process (no-op when none exists), then unfreeze and
    collect the GC heap, so that each group's C++ object (gloo's worker threads) ends while the
    interpreter is alive, when the caller drops its ``ParallelGroups`` (entry points do in the
    ``finally`` of ``main``). A gloo worker left to finalization aborts the process: see
    docs/development.md, "Known issues"."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.unfreeze()  # frozen objects are never collected (launch.engine.startup.freeze_gc_heap)
    gc.collect()
