"""DeepEP's two protocols over torch.distributed (``TorchDistributedBuffer``), behind the
``deep_ep.Buffer`` methods our adapters call, with DeepEP's argument names, shapes and "valid
after the event / the hook" rules, where DeepEP's kernels cannot run (gloo on CPU, NCCL without
``deep_ep``). How each protocol travels, and what differs from DeepEP:
docs/backends.md#deepep-emulation-what-differs."""

from __future__ import annotations

import copy
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from distributed.all2all import deepep_low_latency_protocol as ll
from distributed.all2all.all_to_all import exchange_counts, issue_combine, issue_rows
from distributed.all2all.base import debug_checks_enabled
from distributed.all2all.token_packing import (
    RowLayout,
    pack_sent_rows,
    token_rank_mask,
    unpack_rows,
)
from distributed.collectives import Pending, all_to_all_single
from distributed.comm_handle import CollectiveHandle, CommTiming
from distributed.communicator import Communicator
from distributed.link_emulation import EmulatedLink

IMPLEMENTATION = "torch.distributed emulation of DeepEP's protocol"


class EmulatedTransfer(CollectiveHandle[bool]):
    """One in-flight collective of the emulated buffer: a ``CollectiveHandle`` (``pending``'s
    after-step, then ``finish``, which fills the tensors the Buffer call returned) shaped like a
    ``torch.distributed.Work`` (``wait(timeout)``, ``get_future()``), and both DeepEP's event
    (``current_stream_wait()``: on CPU, no streams, the host blocks) and its recv hook (a call)."""

    __slots__ = ()

    def __init__(
        self,
        *,
        op: str,
        rank: int,
        timeout: datetime.timedelta,
        pending: Pending,
        finish: Callable[[], object] | None,
        timing: CommTiming,
    ) -> None:
        work, after = pending

        def finalize() -> bool:
            for step in (after, finish):
                if step is not None:
                    step()
            return True

        super().__init__(
            op=op, rank=rank, timeout=timeout, work=work, finalize=finalize, timing=timing
        )

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return super().wait()  # blocking wait (the buffer's timeout, not ``timeout``)

    def current_stream_wait(self) -> None:
        self.wait()  # blocking wait (the buffer's timeout)

    __call__ = current_stream_wait  # as DeepEP's recv hook

    def get_future(self):
        if self._work is None:
            raise NotImplementedError("no collective in flight")
        return self._work.get_future()


@dataclass(frozen=True, slots=True, kw_only=True)
class HighThroughputHandle:
    """What ``combine`` needs from an HT ``dispatch``: the rows sent to and received from each
    rank, ``send_token_idx [sum(send_counts)]`` int64 (each sent row's token), ``num_tokens``."""

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_token_idx: Tensor
    num_tokens: int


class TorchDistributedBuffer:
    """Our ``deep_ep.Buffer`` over ``group`` (None: one rank, local copies), rank ``rank`` of
    ``num_ranks``; ``timeout`` bounds every wait; ``num_max_dispatch_tokens_per_rank`` is the
    low-latency capacity it was sized for (0: unchecked)."""

    implementation = IMPLEMENTATION
    # the link (``with_link``) of the HT notify; LL transfers bill their bytes only under one
    link: EmulatedLink | None = None

    def __init__(
        self,
        group: ProcessGroup | Communicator | None,
        *,
        rank: int,
        num_ranks: int,
        timeout: datetime.timedelta,
        num_max_dispatch_tokens_per_rank: int = 0,
    ) -> None:
        self.group = group
        self.rank = rank
        self.group_size = num_ranks
        self.timeout = timeout
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.debug_checks = debug_checks_enabled()  # read once: the per-call checks of LL

    def with_link(self, link: EmulatedLink) -> TorchDistributedBuffer:
        """A copy of this buffer (same group) whose notify completes no earlier than ``link``'s
        deadline, and whose LL transfers bill what DeepEP puts on the wire (a small host read
        each: the emulated link is a CPU study tool)."""
        linked = copy.copy(self)
        linked.link = link
        return linked

    def capture(self) -> EmulatedTransfer:
        """An event on the current stream: on CPU everything before it has run."""
        timing = CommTiming(issued_at_ns=time.perf_counter_ns(), num_bytes=0)
        return self._transfer("capture", (None, None), None, timing, wait=True)

    def _transfer(self, op, pending, finish, timing, *, wait: bool) -> EmulatedTransfer:
        kwargs = {"op": op, "rank": self.rank, "timeout": self.timeout, "timing": timing}
        transfer = EmulatedTransfer(pending=pending, finish=finish, **kwargs)
        if wait:
            transfer.wait()  # blocking wait (timeout: self.timeout): a synchronous call
        return transfer

    def get_dispatch_layout(
        self,
        topk_idx: Tensor,
        num_experts: int,
        previous_event: EmulatedTransfer | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, None, Tensor, Tensor, EmulatedTransfer]:
        """DeepEP's: ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event)`` of ``topk_idx [T, K]`` int64 (-1 = none); local."""
        if previous_event is not None:
            previous_event.current_stream_wait()
        is_token_in_rank = token_rank_mask(
            topk_idx, num_local_experts=num_experts // self.group_size, ep_size=self.group_size
        )
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        per_rank = is_token_in_rank.sum(dim=0).int()
        return per_rank, None, per_expert, is_token_in_rank, self.capture()

    def dispatch(
        self,
        x: Tensor,
        handle: HighThroughputHandle | None = None,
        num_tokens_per_rank: Tensor | None = None,
        num_tokens_per_rdma_rank: Tensor | None = None,
        is_token_in_rank: Tensor | None = None,
        num_tokens_per_expert: Tensor | None = None,
        topk_idx: Tensor | None = None,
        topk_weights: Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        previous_event: EmulatedTransfer | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, list[int], HighThroughputHandle, EmulatedTransfer]:
        """DeepEP's HT dispatch: ``(recv_x [num_recv_tokens, H], recv_topk_idx`` int64 LOCAL ids
        (-1 = elsewhere), ``recv_topk_weights`` float32, ``num_recv_tokens_per_expert_list,
        handle, event)``, rows in (source rank, token) order, valid after the event with
        ``async_finish``. Needs ``get_dispatch_layout``'s tensors and ``topk_idx``.

        Raises:
            ValueError: unsupported options or missing inputs; ranks disagreeing on the row format
                (on every rank). TimeoutError / RuntimeError: the notify step failed.
        """
        layout_args = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx)
        if handle is not None or expert_alignment != 1 or num_worst_tokens or None in layout_args:
            raise ValueError(
                "the emulated buffer's dispatch needs the layout tensors and topk_idx, and "
                "supports neither a cached handle, expert_alignment != 1 nor num_worst_tokens"
            )
        if previous_event is not None:
            previous_event.current_stream_wait()
        if topk_weights is None:
            topk_weights = torch.ones_like(topk_idx, dtype=torch.float32)
        per_rank = num_tokens_per_rank.view(-1, 1)
        counts = torch.cat([per_rank, num_tokens_per_expert.view(per_rank.shape[0], -1)], dim=1)
        return self._dispatch_rows(
            x, topk_idx, topk_weights, is_token_in_rank, counts, async_finish
        )

    def _dispatch_rows(self, x, topk_idx, topk_weights, is_token_in_rank, counts, async_finish):
        """The notify of ``counts`` (``[R, 1 + L]``: rows, then rows per local expert), then the
        payload (``all_to_all``'s exchange of its packed rows)."""
        layout = RowLayout(hidden_size=x.shape[1], num_topk=topk_idx.shape[1], dtype=x.dtype)
        send_counts, recv_counts, notify_ns = exchange_counts(
            counts,
            layout,
            op="deepep_high_throughput dispatch notify",
            group=self.group,
            rank=self.rank,
            timeout=self.timeout,
            link=self.link,
        )
        packed, _, send_token_idx = pack_sent_rows(
            x,
            topk_idx,
            topk_weights,
            layout,
            num_local_experts=counts.shape[1] - 1,
            ep_size=self.group_size,
            is_token_in_rank=is_token_in_rank,
        )
        handle = HighThroughputHandle(
            send_counts=tuple(send_counts[:, 0].tolist()),
            recv_counts=tuple(recv_counts[:, 0].tolist()),
            send_token_idx=send_token_idx,
            num_tokens=x.shape[0],
        )
        recv, pending, timing = issue_rows(
            packed,
            handle.send_counts,
            handle.recv_counts,
            group=self.group,
            rank=self.rank,
            notify_ns=notify_ns,
        )
        op = "deepep_high_throughput dispatch"
        transfer = self._transfer(op, pending, None, timing, wait=not async_finish)
        recv_topk_idx, recv_topk_weights, recv_x = unpack_rows(recv, layout)
        per_expert = recv_counts[:, 1:].sum(0).tolist()
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, transfer

    def combine(
        self,
        x: Tensor,
        handle: HighThroughputHandle,
        topk_weights: Tensor | None = None,
        bias=None,
        previous_event: EmulatedTransfer | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, None, EmulatedTransfer]:
        """DeepEP's HT combine of ``x [num_recv_tokens, H]``: each token's rows summed over ranks,
        unweighted; ``(combined_x [T, H] x's dtype, None, event)``, valid after the event with
        ``async_finish``."""
        if topk_weights is not None or bias is not None:
            raise ValueError("the emulated buffer's combine takes neither topk_weights nor bias")
        if x.dim() != 2 or x.shape[0] != sum(handle.recv_counts):
            raise ValueError(
                f"combine x must be [{sum(handle.recv_counts)}, hidden], got {list(x.shape)}"
            )
        if previous_event is not None:
            previous_event.current_stream_wait()
        pending, timing, sum_rows = issue_combine(
            x,
            handle.send_token_idx,
            handle.send_counts,
            handle.recv_counts,
            num_tokens=handle.num_tokens,
            group=self.group,
            rank=self.rank,
        )
        combined_x = x.new_empty(handle.num_tokens, x.shape[1])

        def finish() -> None:
            combined_x.copy_(sum_rows())

        op = "deepep_high_throughput combine"
        transfer = self._transfer(op, pending, finish, timing, wait=not async_finish)
        return combined_x, None, transfer

    def low_latency_dispatch(
        self,
        x: Tensor,
        topk_idx: Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Tensor, Tensor, ll.LowLatencyHandle, EmulatedTransfer, EmulatedTransfer | None]:
        """DeepEP's LL dispatch of ``x [T, H]`` (``T <= C``, every rank's
        ``num_max_dispatch_tokens_per_rank``) to each of its ``topk_idx [T, K]`` experts:
        ``(recv_x [L, R * C, H]`` (rows past ``recv_count[l]`` unspecified), ``recv_count [L]``
        int32, ``handle, event, hook)``, valid after ``hook()`` with ``return_recv_hook`` (else at
        return, ``hook`` None).

        Raises:
            ValueError: ``use_fp8`` / FP8 options, T above C, C above the buffer's capacity; under
                ``MOE_DBO_DEBUG_CHECKS=1`` a token naming one expert twice (as with DeepEP's
                kernels, the rows past a block's B are otherwise dropped).
        """
        if use_fp8 or round_scale or use_ue8m0:
            raise ValueError("the emulated buffer carries x's dtype: use_fp8 must be False")
        capacity, num_ranks = num_max_dispatch_tokens_per_rank, self.group_size
        self._check_capacity(x.shape[0], capacity)
        buf, handle = ll.pack_dispatch(
            x,
            topk_idx,
            capacity,
            num_experts=num_experts,
            rank=self.rank,
            num_ranks=num_ranks,
            debug_checks=self.debug_checks,
        )
        num_bytes = 0 if self.link is None else ll.dispatch_link_bytes(buf, handle, num_ranks)
        num_local = num_experts // num_ranks
        recv_x, recv_rows = ll.block_buffer(num_local, num_ranks * capacity, x)
        recv_count = torch.zeros(num_local, dtype=torch.int32, device=x.device)

        peers = ll.peer_splits([1] * num_ranks, self.rank)
        transfer = self._issue_blocks(
            "deepep_low_latency dispatch",
            buf[num_ranks:],
            buf[: num_ranks - 1],
            (peers, peers),
            lambda: self._finish_ll_dispatch(
                buf[num_ranks - 1 :],
                handle,
                recv_rows,
                recv_count,
                cumulative_local_expert_recv_stats,
            ),
            num_bytes,
            wait=not return_recv_hook,
        )
        hook = transfer if return_recv_hook else None
        return recv_x, recv_count, handle, transfer, hook

    def _finish_ll_dispatch(
        self, received: Tensor, handle, recv_rows: Tensor, recv_count: Tensor, stats: Tensor | None
    ) -> None:
        """Unpack an LL dispatch's ``received`` blocks into ``recv_rows`` / ``recv_count`` and add
        the counts to DeepEP's ``cumulative_local_expert_recv_stats`` (``stats``) if given."""
        ll.unpack_dispatch(
            received, handle, recv_rows, recv_count, rank=self.rank, debug_checks=self.debug_checks
        )
        if stats is not None:
            stats.add_(recv_count)

    def low_latency_combine(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        handle: ll.LowLatencyHandle,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Tensor | None = None,
    ) -> tuple[Tensor, EmulatedTransfer, EmulatedTransfer | None]:
        """DeepEP's LL combine of the UNWEIGHTED expert outputs ``x [L, R * C, H]`` (rows as the
        dispatch delivered them): ``(combined_x [T, H] x's dtype, event, hook)``, each token's
        ``sum_k topk_weights[t, k] * row``, valid after ``hook()`` with ``return_recv_hook``.

        Raises:
            ValueError: shapes that do not match the handle, or the dispatch's hook never ran.
        """
        num_ranks = self.group_size
        ll.check_combine(x, topk_idx, topk_weights, handle, num_ranks)
        buf = ll.pack_combine(x, handle, num_ranks=num_ranks)
        num_bytes = 0 if self.link is None else ll.combine_link_bytes(handle, x, self.rank)
        combined_x = out if out is not None else x.new_empty(topk_idx.shape[0], handle.hidden)

        def finish() -> None:
            ll.weighted_sum(
                buf[num_ranks - 1 :], handle, topk_idx, topk_weights, combined_x, rank=self.rank
            )

        peers = ll.peer_splits([1] * num_ranks, self.rank)
        transfer = self._issue_blocks(
            "deepep_low_latency combine",
            buf[num_ranks:],
            buf[: num_ranks - 1],
            (peers, peers),
            finish,
            num_bytes,
            wait=not return_recv_hook,
        )
        return combined_x, transfer, transfer if return_recv_hook else None

    def _check_capacity(self, num_tokens: int, capacity: int) -> None:
        allocated = self.num_max_dispatch_tokens_per_rank
        if capacity < 1 or (allocated and capacity > allocated):
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank={capacity} must be in [1, {allocated}] (the "
                f"capacity this buffer was sized for)"
            )
        if num_tokens > capacity:
            raise ValueError(
                f"low_latency_dispatch of {num_tokens} tokens exceeds "
                f"num_max_dispatch_tokens_per_rank={capacity}"
            )

    def _issue_blocks(self, op, recv, send, splits, finish, num_bytes, *, wait: bool):
        """One ``all_to_all_single`` of ``send`` into ``recv`` (``splits``: input, output), billed
        ``num_bytes`` (what DeepEP's kernels put on the wire), as an ``EmulatedTransfer``."""
        issued_at_ns = time.perf_counter_ns()
        pending = all_to_all_single(
            recv, send, output_split_sizes=splits[1], input_split_sizes=splits[0], group=self.group
        )
        timing = CommTiming(issued_at_ns=issued_at_ns, num_bytes=num_bytes)
        return self._transfer(op, pending, finish, timing, wait=wait)
