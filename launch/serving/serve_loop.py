"""The serving loop every DP rank runs: one control exchange, then one engine step, in lockstep
(``ServeLoop``, ``ControlOrders``, ``RankReport``). The exchange, and idling without spinning:
docs/serving.md#the-serve-loop-lockstep-control-exchange."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from distributed.comm_handle import comm_error
from launch.engine.dp_load_balancer import DPLoadBalancer
from launch.engine.llm_engine import LLMEngine
from launch.engine.request import Request
from launch.serving.engine_bridge import (
    EngineBridge,
    NewRequest,
    ProfileOrder,
    RequestOutput,
    ServerShuttingDown,
)
from launch.serving.metrics import ServerMetrics

HEARTBEAT_S = 0.5


def _max_num_tokens(request: NewRequest) -> int:
    """Prompt + max new tokens: the ``minimum_tokens`` load balancer's weight of a request."""
    return len(request.prompt_token_ids) + request.sampling_params.max_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlOrders:
    """Rank 0's orders for one iteration."""

    assignments: tuple[tuple[int, NewRequest], ...] = ()  # (dp_rank, request)
    aborts: tuple[int, ...] = ()
    profile: tuple[str, ...] = ()  # profiler orders ("start" / "stop"), in order
    is_shutting_down: bool = False
    should_exit: bool = False  # every rank leaves the loop after this exchange


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """One DP rank's state after its last step."""

    outputs: tuple[RequestOutput, ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0  # fraction of this rank's KV blocks in use
    wants_shutdown: bool = False  # this rank got SIGTERM
    # per profiler order of the last exchange: None (applied) or why it failed on this rank
    profile_errors: tuple[str | None, ...] = ()
    ran_step: bool = False
    is_ubatched: bool = False
    step_time_s: float = 0.0


class ServeLoop:
    """Runs ``engine`` in DP lockstep until rank 0 orders every rank to exit.

    ``bridge`` and ``metrics`` exist on rank 0 only. ``stop_requested`` says whether this process
    got SIGTERM (or SIGINT, or lost its launcher); ``stop_reason`` names which, for the error
    that fails what is left. After SIGTERM the server stops accepting, lets in-flight requests
    finish for up to ``shutdown_timeout_s`` seconds, then fails the rest with an explicit error, and
    every rank exits.
    """

    def __init__(
        self,
        *,
        engine: LLMEngine,
        control_group,
        dp_rank: int,
        dp_size: int,
        stop_requested: Callable[[], bool],
        shutdown_timeout_s: float,
        stop_reason: Callable[[], str | None] = lambda: "SIGTERM",
        bridge: EngineBridge | None = None,
        metrics: ServerMetrics | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.engine = engine
        self.control_group = control_group
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.stop_requested = stop_requested
        self.stop_reason = stop_reason
        self.shutdown_timeout_s = shutdown_timeout_s
        self.bridge = bridge
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.load_balancer = DPLoadBalancer(dp_size, engine.args.load_balance_method)
        self._num_sent: dict[int, int] = {}  # request id -> output tokens already reported
        self._shutdown_deadline: float | None = None
        self._error_outputs: list[RequestOutput] = []
        # rank 0: profiler orders taken for the next exchange, and those sent in the last one,
        # resolved once every rank's report says how applying them went
        self._profile_orders: list[ProfileOrder] = []
        self._profile_orders_sent: list[ProfileOrder] = []
        self._profile_errors: tuple[str | None, ...] = ()  # this rank's, for its next report

    def run(self) -> int:
        """Serve until told to exit; the number of requests failed at shutdown (rank 0)."""
        report = RankReport()
        any_work = False
        num_failed = 0
        while True:
            orders = self._make_orders(any_work) if self.dp_rank == 0 else None
            if orders is not None and orders.should_exit:
                reason = self.stop_reason() or "a stop request on another rank"
                error = ServerShuttingDown(
                    f"the server shut down ({reason}) before this request finished "
                    f"(--shutdown-timeout {self.shutdown_timeout_s:g} s)"
                )
                num_failed = self.bridge.fail_all(error)
                for order in self._profile_orders:  # taken, never to be applied
                    self.bridge.finish_profile_order(order, error)
            parts = self._exchange(orders, report)
            orders = parts[0][0]
            reports = [part[1] for part in parts]
            if self.dp_rank == 0:
                self._collect(reports)
            if orders.should_exit:
                return num_failed
            self._apply(orders)
            self._profile_errors = self._apply_profile(orders.profile)
            self._profile_orders_sent, self._profile_orders = self._profile_orders, []
            num_new = len(orders.assignments)
            any_work = num_new > 0 or any(r.num_running + r.num_waiting > 0 for r in reports)
            report = self._step() if any_work else self._report(ran_step=False)

    def _exchange(self, orders: ControlOrders | None, report: RankReport) -> list:
        """Every rank's (orders, report): one blocking all_gather_object over the control group
        (timeout: the group's). Raises TimeoutError / RuntimeError naming the exchange."""
        parts: list = [None] * self.dp_size
        try:
            dist.all_gather_object(parts, (orders, report), group=self.control_group)
        except RuntimeError as exc:  # gloo's timeout names no collective: say which
            timeout = self.engine.groups.timeout
            op = "the serve loop's control exchange (all_gather_object over the control group)"
            raise comm_error(op, self.dp_rank, timeout, exc) from exc
        return parts

    def _make_orders(self, any_work: bool) -> ControlOrders:
        bridge = self.bridge
        if self.stop_requested() and bridge.is_accepting:
            bridge.stop_accepting()
            self._shutdown_deadline = time.monotonic() + self.shutdown_timeout_s
        shutting_down = not bridge.is_accepting
        # profiler orders in flight: their answer comes with the next exchange, so no idle wait
        busy = any_work or shutting_down or self._profile_orders_sent
        new, aborts = bridge.take(0 if busy else self.heartbeat_s)
        self._profile_orders = bridge.take_profile_orders()
        for request_id in aborts:
            self.load_balancer.close(request_id)
        assignments = tuple(
            (self.load_balancer.assign(r.request_id, _max_num_tokens(r)), r) for r in new
        )
        if self.metrics is not None:
            self.metrics.requests_received.inc(len(new))
            for dp_rank, _ in assignments:
                self.metrics.requests_routed.labels(dp_rank=str(dp_rank)).inc()
            self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in new))
        should_exit = shutting_down and (
            (bridge.num_in_flight == 0 and not any_work and not new)
            or time.monotonic() >= self._shutdown_deadline
        )
        if shutting_down and not should_exit and not any_work and not new:
            time.sleep(min(self.heartbeat_s, 0.05))  # waiting for outputs in transit, not spinning
        return ControlOrders(
            assignments=assignments,
            aborts=tuple(aborts),
            profile=tuple(order.action for order in self._profile_orders),
            is_shutting_down=shutting_down,
            should_exit=should_exit,
        )

    def _collect(self, reports: list[RankReport]) -> None:
        """Rank 0: pass every rank's outputs to the HTTP handlers, resolve the profiler orders
        they applied; update metrics."""
        self._finish_profile_orders(reports)
        self.bridge.note_running(sum(r.num_running for r in reports))
        for dp_rank, report in enumerate(reports):
            if report.wants_shutdown and self.bridge.is_accepting:
                self.bridge.stop_accepting()
                self._shutdown_deadline = time.monotonic() + self.shutdown_timeout_s
            for output in report.outputs:
                if output.is_last:
                    self.load_balancer.close(output.request_id)
                if self.metrics is not None:  # counted before the client can see the output
                    self.metrics.generation_tokens.inc(len(output.new_token_ids))
                    if output.is_last:
                        reason = "error" if output.error else output.finish_reason
                        self.metrics.requests_finished.labels(finish_reason=reason).inc()
                self.bridge.deliver(output)
            if self.metrics is not None:
                self.metrics.update_rank(
                    dp_rank,
                    num_running=report.num_running,
                    num_waiting=report.num_waiting,
                    num_preemptions=report.num_preemptions,
                    kv_cache_usage=report.kv_cache_usage,
                )
        if self.metrics is not None and reports[0].ran_step:
            self.metrics.record_step(
                is_ubatched=reports[0].is_ubatched, step_time_s=reports[0].step_time_s
            )
            # rank 0's policy: every rank's is identical (fed the same combined vote data)
            self.metrics.set_dbo_adaptive(
                crossover_tokens=self.engine.observability.dbo_crossover_tokens(),
                num_exploration_steps=self.engine.observability.stats.num_dbo_exploration_steps,
            )

    def _apply(self, orders: ControlOrders) -> None:
        # assignments before aborts: a request aborted right after it was sent comes in one order
        for dp_rank, new in orders.assignments:
            if dp_rank != self.dp_rank:
                continue
            try:
                self.engine.add_request(
                    Request(
                        request_id=new.request_id,
                        prompt_token_ids=list(new.prompt_token_ids),
                        sampling_params=new.sampling_params,
                    )
                )
                self._num_sent[new.request_id] = 0
            except Exception as e:  # noqa: BLE001 - rank 0 checked it first; fail this request alone
                self._error_outputs.append(RequestOutput(request_id=new.request_id, error=e))
        for request_id in orders.aborts:
            if self.engine.abort_request(request_id) is not None:
                self._num_sent.pop(request_id, None)
                # reported so that rank 0 counts it (requests_finished{finish_reason="abort"})
                self._error_outputs.append(
                    RequestOutput(request_id=request_id, finish_reason="abort")
                )

    def _apply_profile(self, actions: tuple[str, ...]) -> tuple[str | None, ...]:
        """Start or stop this rank's profiler per order (a stop writes its trace); per order
        None, or why it failed here (for the next report)."""
        errors: list[str | None] = []
        for action in actions:
            try:
                if action == "start":
                    self.engine.observability.start_profile()
                else:
                    self.engine.observability.stop_profile()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - answered to the order's client, not fatal
                errors.append(f"[rank {self.dp_rank}] {type(e).__name__}: {e}")
        return tuple(errors)

    def _finish_profile_orders(self, reports: list[RankReport]) -> None:
        """Rank 0: resolve the orders of the last exchange now that every rank has reported
        applying them: done, or failed with the first rank's error."""
        for index, order in enumerate(self._profile_orders_sent):
            errors = [r.profile_errors[index] for r in reports if r.profile_errors[index]]
            self.bridge.finish_profile_order(order, RuntimeError(errors[0]) if errors else None)
        self._profile_orders_sent = []

    def _step(self) -> RankReport:
        stats = self.engine.observability.stats
        num_ubatched = stats.num_ubatched_steps
        start = time.perf_counter()
        finished, _ = self.engine.step()
        step_time_s = time.perf_counter() - start
        outputs = list(self._error_outputs)
        self._error_outputs.clear()
        for request in [*self.engine.running_requests, *finished]:
            outputs += self._new_output(request)
        return self._report(
            ran_step=True,
            outputs=tuple(outputs),
            is_ubatched=stats.num_ubatched_steps > num_ubatched,
            step_time_s=step_time_s,
        )

    def _new_output(self, request: Request) -> list[RequestOutput]:
        num_sent = self._num_sent.get(request.request_id, 0)
        is_finished = request.finish_reason is not None
        if len(request.output_token_ids) == num_sent and not is_finished:
            return []
        if is_finished:
            self._num_sent.pop(request.request_id, None)
        else:
            self._num_sent[request.request_id] = len(request.output_token_ids)
        if request.finish_reason == "error":  # failed by its own data; the others go on
            error = RuntimeError(request.error)
            return [RequestOutput(request_id=request.request_id, error=error)]
        return [
            RequestOutput(
                request_id=request.request_id,
                new_token_ids=tuple(request.output_token_ids[num_sent:]),
                new_logprobs=tuple(request.output_logprobs[num_sent:]),
                finish_reason=request.finish_reason,
            )
        ]

    def _report(self, *, ran_step: bool, outputs=(), **step) -> RankReport:
        engine = self.engine
        if not ran_step and self._error_outputs:
            outputs, self._error_outputs = tuple(self._error_outputs), []
        profile_errors, self._profile_errors = self._profile_errors, ()
        return RankReport(
            outputs=tuple(outputs),
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_preemptions=self.engine.observability.stats.num_preemptions,
            kv_cache_usage=engine.kv_cache_usage,
            wants_shutdown=self.stop_requested(),
            profile_errors=profile_errors,
            ran_step=ran_step,
            **step,
        )
