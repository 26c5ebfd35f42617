"""Prometheus metrics of the server (rank 0), on a registry of its own (never the global one).

Rank 0's engine loop updates them each step from every DP rank's report; ``GET /metrics`` renders
them in the Prometheus text format (``prometheus_client``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "moe_dbo"
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Counters and gauges of requests, tokens, per-DP-rank queues and engine steps."""

    def __init__(self, *, dp_size: int) -> None:
        self.registry = CollectorRegistry()
        # registration order is the order /metrics lists them in
        self._add_request_metrics()
        self._add_rank_metrics()
        self._add_step_metrics()
        for dp_rank in range(dp_size):
            self.update_rank(dp_rank, num_running=0, num_waiting=0, num_preemptions=0)
        self._num_steps = 0
        self._num_ubatched = 0

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

    def _add_request_metrics(self) -> None:
        """Requests through the front end and their tokens."""
        self.requests_received = self._counter(
            "requests_received", "Requests accepted by the HTTP front end"
        )
        self.requests_routed = self._counter(
            "requests_routed", "Requests sent to each DP rank by the DP load balancer", "dp_rank"
        )
        self.requests_rejected = self._counter(
            "requests_rejected", "Requests answered with a 4xx/503 error"
        )
        self.requests_finished = self._counter(
            "requests_finished",
            "Requests ended, by finish reason (stop, length, abort, error)",
            "finish_reason",
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated")

    def _add_rank_metrics(self) -> None:
        """Per-DP-rank queues and KV cache use (label ``dp_rank``)."""
        self.num_requests_running = self._gauge(
            "num_requests_running", "Running requests per DP rank", "dp_rank"
        )
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Waiting requests per DP rank", "dp_rank"
        )
        self.num_preemptions = self._gauge(
            "num_preemptions", "Preemptions so far per DP rank", "dp_rank"
        )
        self.kv_cache_usage = self._gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use per DP rank (1 = full), as vLLM's",
            "dp_rank",
        )

    def _add_step_metrics(self) -> None:
        """Engine steps, how many DBO microbatched, and the adaptive DBO policy's state."""
        self.engine_steps = self._counter(
            "engine_steps", "Lockstep engine steps in which some rank had work"
        )
        self.ubatched_steps = self._counter(
            "engine_ubatched_steps", "Engine steps microbatched by DBO"
        )
        self.ubatched_step_fraction = self._gauge(
            "engine_ubatched_step_fraction", "Fraction of engine steps microbatched by DBO"
        )
        self.step_time = Histogram(
            f"{PREFIX}_engine_step_seconds",
            "Wall time of one engine step on rank 0",
            buckets=STEP_TIME_BUCKETS,
            registry=self.registry,
        )
        self.dbo_crossover_tokens = self._gauge(
            "adaptive_crossover_tokens",
            "Tokens per rank from which adaptive DBO found microbatching to pay, per batch kind "
            "with --dbo-*-token-threshold auto (+Inf: never so far, NaN: not yet measured)",
            "kind",
        )
        self.dbo_exploration_steps = self._gauge(
            "adaptive_exploration_steps",
            "Engine steps the adaptive DBO policy spent exploring (rank 0)",
        )

    def update_rank(
        self,
        dp_rank: int,
        *,
        num_running: int,
        num_waiting: int,
        num_preemptions: int,
        kv_cache_usage: float = 0.0,
    ) -> None:
        label = str(dp_rank)
        self.kv_cache_usage.labels(dp_rank=label).set(kv_cache_usage)
        self.num_requests_running.labels(dp_rank=label).set(num_running)
        self.num_requests_waiting.labels(dp_rank=label).set(num_waiting)
        self.num_preemptions.labels(dp_rank=label).set(num_preemptions)

    def record_step(self, *, is_ubatched: bool, step_time_s: float) -> None:
        self._num_steps += 1
        self._num_ubatched += is_ubatched
        self.engine_steps.inc()
        if is_ubatched:
            self.ubatched_steps.inc()
        self.ubatched_step_fraction.set(self._num_ubatched / self._num_steps)
        self.step_time.observe(step_time_s)

    def set_dbo_adaptive(
        self, *, crossover_tokens: dict[str, float], num_exploration_steps: int
    ) -> None:
        """The adaptive DBO policy's learned crossover per kind ("decode" / "prefill")."""
        for kind, value in crossover_tokens.items():
            self.dbo_crossover_tokens.labels(kind=kind).set(value)
        self.dbo_exploration_steps.set(num_exploration_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
