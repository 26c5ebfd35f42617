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
        r = self.registry
        self.requests_received = Counter(
            f"{PREFIX}_requests_received", "Requests accepted by the HTTP front end", registry=r
        )
        self.requests_routed = Counter(
            f"{PREFIX}_requests_routed",
            "Requests sent to each DP rank by the least-loaded router",
            ["dp_rank"],
            registry=r,
        )
        self.requests_rejected = Counter(
            f"{PREFIX}_requests_rejected", "Requests answered with a 4xx/503 error", registry=r
        )
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished",
            "Requests ended, by finish reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated", registry=r
        )
        self.num_requests_running = Gauge(
            f"{PREFIX}_num_requests_running",
            "Running requests per DP rank",
            ["dp_rank"],
            registry=r,
        )
        self.num_requests_waiting = Gauge(
            f"{PREFIX}_num_requests_waiting",
            "Waiting requests per DP rank",
            ["dp_rank"],
            registry=r,
        )
        self.num_preemptions = Gauge(
            f"{PREFIX}_num_preemptions", "Preemptions so far per DP rank", ["dp_rank"], registry=r
        )
        self.kv_cache_usage = Gauge(
            f"{PREFIX}_kv_cache_usage_perc",
            "Fraction of KV cache blocks in use per DP rank (1 = full), as vLLM's",
            ["dp_rank"],
            registry=r,
        )
        self.engine_steps = Counter(
            f"{PREFIX}_engine_steps",
            "Lockstep engine steps in which some rank had work",
            registry=r,
        )
        self.ubatched_steps = Counter(
            f"{PREFIX}_engine_ubatched_steps", "Engine steps microbatched by DBO", registry=r
        )
        self.ubatched_step_fraction = Gauge(
            f"{PREFIX}_engine_ubatched_step_fraction",
            "Fraction of engine steps microbatched by DBO",
            registry=r,
        )
        self.step_time = Histogram(
            f"{PREFIX}_engine_step_seconds",
            "Wall time of one engine step on rank 0",
            buckets=STEP_TIME_BUCKETS,
            registry=r,
        )
        self.dbo_crossover_tokens = Gauge(
            f"{PREFIX}_adaptive_crossover_tokens",
            "Tokens per rank from which adaptive DBO found microbatching to pay, per batch kind "
            "with --dbo-*-token-threshold auto (+Inf: never so far, NaN: not yet measured)",
            ["kind"],
            registry=r,
        )
        self.dbo_exploration_steps = Gauge(
            f"{PREFIX}_adaptive_exploration_steps",
            "Engine steps the adaptive DBO policy spent exploring (rank 0)",
            registry=r,
        )
        for dp_rank in range(dp_size):
            self.update_rank(dp_rank, num_running=0, num_waiting=0, num_preemptions=0)
        self._num_steps = 0
        self._num_ubatched = 0

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
