"""The expert all-to-all of one rank's engine: the registered pattern over the rank's EP group
(None without expert parallelism), behind an emulated link when one is given, checked against the
ubatches DBO keeps in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distributed.all2all import make_prepare_finalize
from distributed.all2all.base import FusedMoEPrepareAndFinalize
from distributed.link_emulation import EmulatedLink, LinkSpec

if TYPE_CHECKING:
    from distributed.parallel_state import ParallelGroups


def maybe_make_prepare_finalize(
    name: str,
    groups: ParallelGroups,
    *,
    num_experts: int,
    hidden_size: int,
    num_max_dispatch_tokens_per_rank: int,
    link_spec: LinkSpec | None = None,
    num_ubatches: int | None = None,
) -> FusedMoEPrepareAndFinalize | None:
    """The all-to-all ``name`` (``--all2all-backend``) over ``groups.ep_comm``, or None when
    ``groups.ep_size == 1``. ``num_max_dispatch_tokens_per_rank``: the most rows one rank
    dispatches in a step (the scheduler's token budget; sizes DeepEP's buffers).
    ``link_spec``: put the transfers behind an ``EmulatedLink`` (``--emulate-link``).
    ``num_ubatches``: under DBO, the ubatches a step is cut into (None without DBO).

    Raises:
        ValueError: as ``make_prepare_finalize``; under DBO, more ubatches than the backend can
            have in flight (``check_num_ubatches``).
    """
    if groups.ep_size == 1:
        return None
    backend = make_prepare_finalize(
        name,
        ep_group=groups.ep_comm,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        num_experts=num_experts,
        timeout=groups.timeout,
        # DeepEP's buffers: no step (microbatched or not) has more rows per rank than the
        # scheduler's token budget, so a low-latency dispatch never overflows its slots
        hidden_size=hidden_size,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
    )
    if link_spec is not None:
        backend = backend.with_link(EmulatedLink(link_spec))
    if num_ubatches is not None:
        check_num_ubatches(backend, num_ubatches)
    return backend


def check_num_ubatches(backend: FusedMoEPrepareAndFinalize | None, num_ubatches: int) -> None:
    """Raise ValueError if ``backend`` (None: no expert parallelism) cannot have
    ``num_ubatches`` ubatches' transfers in flight at once (its ``max_num_ubatches``)."""
    limit = None if backend is None else backend.max_num_ubatches
    if limit is not None and num_ubatches > limit:
        raise ValueError(
            f"--ubatch-size {num_ubatches}: {backend.name} ({backend.implementation}) holds at "
            f"most {limit} ubatches' results at a time; use --ubatch-size <= {limit} or another "
            "--all2all-backend"
        )
