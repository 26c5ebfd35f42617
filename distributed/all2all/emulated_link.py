"""The emulated link (``distributed.link_emulation``) as a wrapper around any expert all-to-all
backend: ``EmulatedLinkBackend(inner, link)``.

The wrapped backend runs unchanged; the wrapper books each of its transfers on the rank's
``EmulatedLink`` from the handle's ``CommTiming`` (issue time, and the larger of the bytes sent
and received) and hands back a ``LinkDelayedHandle`` that completes no earlier than the link's
deadline. A blocking exchange the backend runs inside a call (a count exchange: DeepEP's notify,
waited through ``comm_handle.wait_blocking_exchange``) is delayed the same way before the backend
goes on, so its payload is issued after the emulated exchange, as on a slow link.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

from torch import Tensor

from distributed.all2all.base import (
    All2AllBackend,
    BatchedDispatchResult,
    DispatchMetadata,
    DispatchResult,
)
from distributed.all2all.deepep_kernels import DEEPEP_KERNELS
from distributed.comm_handle import CommHandle, CommTiming, wrap_blocking_exchanges
from distributed.link_emulation import EmulatedLink, sleep_until

T = TypeVar("T")

# The backend's declarations the engine and the modular kernel read, taken over from the inner one.
_DECLARATIONS = (
    "name",
    "activation_format",
    "implementation",
    "blocks_under_dbo",
    "max_num_ubatches",
)


class LinkDelayedHandle(Generic[T]):
    """A ``CommHandle`` that completes no earlier than ``deadline_ns`` (``perf_counter_ns``).

    ``wait()`` first sleeps until the deadline (a blocking wait bounded by it; ``time.sleep``
    releases the GIL, so the other ubatch thread computes meanwhile), then completes the inner
    handle (its collective's wait, then its finalize step): the receive-side work starts once
    both the bytes and the deadline are there. ``timing.completed_at_ns`` is never earlier than
    the deadline; ``timing.payload_at_ns`` is when the inner handle's bytes were there.
    """

    __slots__ = ("_inner", "deadline_ns")

    def __init__(self, inner: CommHandle[T], deadline_ns: int) -> None:
        self._inner = inner
        self.deadline_ns = deadline_ns

    @property
    def timing(self) -> CommTiming:
        timing = self._inner.timing
        arrived_ns = timing.completed_at_ns
        if arrived_ns is None:
            return timing
        return dataclasses.replace(
            timing, completed_at_ns=max(arrived_ns, self.deadline_ns), payload_at_ns=arrived_ns
        )

    def is_completed(self) -> bool:
        return time.perf_counter_ns() >= self.deadline_ns and self._inner.is_completed()

    def wait(self) -> T:
        sleep_until(self.deadline_ns)  # blocking wait, bounded by the emulated deadline
        return self._inner.wait()  # blocking wait (the inner handle's timeout)


class EmulatedLinkBackend(All2AllBackend):
    """``inner`` behind an emulated slower link (see the module docstring).

    Every transfer of ``inner``, its count exchange included, completes no earlier than
    ``start + latency + bytes / bandwidth`` on ``link`` (``EmulatedLink``: one rank's transfers
    one after the other; bytes: the larger of ``timing.num_bytes`` and ``timing.num_recv_bytes``).
    Results and declarations (``name``, ``activation_format``, ...) are ``inner``'s.

    Raises:
        ValueError: if ``inner`` runs DeepEP's kernels (their completion is on the GPU stream,
            not a host wait the link could delay: the link model is a CPU tool).
    """

    def __init__(self, inner: All2AllBackend, link: EmulatedLink) -> None:
        if inner.implementation == DEEPEP_KERNELS:
            raise ValueError(
                f"--emulate-link applies to the torch.distributed implementations only, not to "
                f"{inner.name} on {DEEPEP_KERNELS}"
            )
        super().__init__(
            ep_group=inner.ep_group,
            ep_rank=inner.ep_rank,
            ep_size=inner.ep_size,
            num_experts=inner.num_experts,
            timeout=inner.timeout,
        )
        for attr in _DECLARATIONS:
            setattr(self, attr, getattr(inner, attr))
        self.inner = inner
        self.link = link

    def delayed(self, handle: CommHandle[T]) -> LinkDelayedHandle[T]:
        """Book ``handle``'s transfer on the link; the handle delayed to the link's deadline."""
        timing = handle.timing
        deadline_ns = self.link.deadline_ns(timing.issued_at_ns, timing.num_link_bytes)
        return LinkDelayedHandle(handle, deadline_ns)

    def dispatch(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        *,
        async_op: bool = False,
        num_tokens_across_ep: Sequence[int] | None = None,
    ) -> CommHandle[DispatchResult | BatchedDispatchResult]:
        # async: the delay must apply before the inner handle's wait
        with wrap_blocking_exchanges(self.delayed):
            handle = self.inner.dispatch(
                hidden_states,
                topk_ids,
                topk_weights,
                async_op=True,
                num_tokens_across_ep=num_tokens_across_ep,
            )
        return self._issued(handle, async_op)

    def combine(
        self, expert_output: Tensor, metadata: DispatchMetadata, *, async_op: bool = False
    ) -> CommHandle[Tensor]:
        with wrap_blocking_exchanges(self.delayed):
            handle = self.inner.combine(expert_output, metadata, async_op=True)
        return self._issued(handle, async_op)

    def _issued(self, handle: CommHandle[T], async_op: bool) -> CommHandle[T]:
        delayed = self.delayed(handle)
        if not async_op:
            delayed.wait()  # blocking wait (the link's deadline, then inner's timeout)
        return delayed
