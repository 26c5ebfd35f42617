"""Adaptive DBO (``--dbo-*-token-threshold auto``): ``AdaptiveDBOPolicy`` learns, per bucket of
batch shapes, whether microbatching pays, from step times every DP rank holds alike; its config,
choices and the planner's prior. The rule (buckets, samples, explore / exploit, re-checks, the
prior): docs/dbo.md, "Adaptive policy: the rule"."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

KINDS = ("decode", "prefill")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptivePolicyConfig:
    """Knobs of the adaptive rule (see the module docstring).

    Raises:
        ValueError: a count < 1, ``window < num_explore_steps`` or a tolerance outside ``[0, 1)``.
    """

    num_explore_steps: int = 4  # samples per arm before a bucket decides
    window: int = 5  # samples per arm whose median is the arm's estimate
    tie_tolerance: float = 0.01  # on must beat off by this fraction of off's median
    # chosen arm's median moving by this fraction: explore again. Not less: on a loaded 2-core
    # machine the median of 5 step times swings by tens of percent with no change in the workload.
    drift_tolerance: float = 0.5
    recheck_interval: int = 500  # exploit steps of a bucket before it explores again
    # a prior's predicted speedup counts when it is this far from 1 (closer, the planner's error
    # could flip it); then a new bucket explores this many steps per arm (at most
    # num_explore_steps) and decides there if the samples agree
    prior_margin: float = 0.15
    num_prior_explore_steps: int = 2

    def __post_init__(self) -> None:
        for name in ("num_explore_steps", "window", "recheck_interval", "num_prior_explore_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.window < self.num_explore_steps:
            raise ValueError(
                f"window ({self.window}) must be >= num_explore_steps ({self.num_explore_steps})"
            )
        for name in ("tie_tolerance", "drift_tolerance", "prior_margin"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """A class of batch shapes: ``kind`` ("decode" / "prefill") and ``log2_tokens`` (the bucket
    covers ``[2**log2_tokens, 2**(log2_tokens + 1))`` tokens per rank)."""

    kind: str
    log2_tokens: int

    @staticmethod
    def of(*, num_tokens: int, is_decode_only: bool) -> Bucket:
        """The bucket of a step whose largest DP rank batch has ``num_tokens`` (>= 1) tokens.

        Raises:
            ValueError: if ``num_tokens < 1``.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        return Bucket(
            kind="decode" if is_decode_only else "prefill", log2_tokens=num_tokens.bit_length() - 1
        )

    @property
    def min_tokens(self) -> int:
        return 1 << self.log2_tokens

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.min_tokens}-{2 * self.min_tokens - 1}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyChoice:
    """The policy's answer for one step: microbatch or not, and whether this step explores."""

    bucket: Bucket
    use_ubatch: bool
    is_exploring: bool


@dataclass(slots=True)
class _BucketState:
    samples: dict[bool, deque] = field(default_factory=dict)  # arm -> last `window` step ms
    num_round: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    last_explored: bool | None = None
    choice: bool | None = None  # None while exploring
    reference_ms: float = 0.0  # chosen arm's median at the decision
    num_since_decision: int = 0
    last_decision: bool | None = None  # survives re-exploration (for the crossover)
    num_explore: int = 0  # samples per arm before deciding (shorter with an agreeing prior)
    prior_choice: bool | None = None  # the prior's arm while it shortens the exploration


class AdaptiveDBOPolicy:
    """Per-bucket step-time estimates with microbatching on and off, and the choice between them.

    Identical inputs in identical order give identical choices (no clock, no randomness), so every
    DP rank that feeds its policy the combined vote data reaches the same decision.

    Use per step: ``record(prev_step_ms)`` with the combined time of the previous step (it is
    attributed to the bucket and arm that ``begin_step`` named), ``choose(bucket)``, then
    ``begin_step(bucket, use_ubatch)`` with what actually runs.

    ``prior``: the predicted speedup (DBO off / on; > 1: microbatching pays) of a bucket, or None
    where there is no prediction (see the module docstring, **Prior**); ``prior_from_table``
    builds one from ``launch.plan --write-prior``'s JSON.
    """

    def __init__(
        self,
        config: AdaptivePolicyConfig | None = None,
        prior: Callable[[Bucket], float | None] | None = None,
    ) -> None:
        self.config = config or AdaptivePolicyConfig()
        self._buckets: dict[Bucket, _BucketState] = {}
        self._pending: tuple[Bucket, bool] | None = None
        self.num_exploration_steps = 0
        self.prior = prior

    def _state(self, bucket: Bucket) -> _BucketState:
        state = self._buckets.get(bucket)
        if state is None:
            w = self.config.window
            state = _BucketState(
                samples={False: deque(maxlen=w), True: deque(maxlen=w)},
                num_explore=self.config.num_explore_steps,
            )
            predicted = self.prior(bucket) if self.prior is not None else None
            if predicted is not None and abs(predicted - 1.0) > self.config.prior_margin:
                state.prior_choice = predicted > 1.0
                state.num_explore = min(
                    self.config.num_prior_explore_steps, self.config.num_explore_steps
                )
            self._buckets[bucket] = state
        return state

    def is_exploring(self, bucket: Bucket) -> bool:
        return self._state(bucket).choice is None

    def choose(self, bucket: Bucket) -> PolicyChoice:
        """Exploration arm (fewer samples this round; equal: repeat the last, starting with off)
        or the decided arm."""
        state = self._state(bucket)
        if state.choice is not None:
            return PolicyChoice(bucket=bucket, use_ubatch=state.choice, is_exploring=False)
        n_off, n_on = state.num_round[False], state.num_round[True]
        arm = n_on < n_off if n_on != n_off else bool(state.last_explored)
        return PolicyChoice(bucket=bucket, use_ubatch=arm, is_exploring=True)

    def begin_step(self, bucket: Bucket, use_ubatch: bool) -> None:
        """Note what this step runs; the next ``record`` attributes its time to it."""
        self._pending = (bucket, use_ubatch)
        if self._state(bucket).choice is None:
            self.num_exploration_steps += 1

    def cancel_pending(self) -> None:
        """Forget the pending step (it ran outside the policy, e.g. with DBO forced off)."""
        self._pending = None

    def record(self, step_ms: float) -> None:
        """Attribute ``step_ms`` (the slowest rank's time of the step ``begin_step`` named) to its
        bucket and arm, then decide or re-check. ``step_ms <= 0`` (not measured) is dropped."""
        pending, self._pending = self._pending, None
        if pending is None or not step_ms > 0:
            return
        bucket, arm = pending
        state = self._state(bucket)
        state.samples[arm].append(step_ms)
        if state.choice is None:
            state.num_round[arm] += 1
            state.last_explored = arm
            if min(state.num_round.values()) >= state.num_explore:
                self._decide(state)
        elif arm == state.choice:
            state.num_since_decision += 1
            self._maybe_recheck(state)

    def _decide(self, state: _BucketState) -> None:
        med_off = statistics.median(state.samples[False])
        med_on = statistics.median(state.samples[True])
        measured = med_on < med_off * (1.0 - self.config.tie_tolerance)
        if state.prior_choice is not None and measured != state.prior_choice:
            # the samples contradict the prior: explore as long as without one, samples decide
            state.prior_choice = None
            state.num_explore = self.config.num_explore_steps
            if min(state.num_round.values()) < state.num_explore:
                return
        state.prior_choice = None
        state.choice = measured
        state.last_decision = state.choice
        state.reference_ms = med_on if state.choice else med_off
        state.num_since_decision = 0

    def _maybe_recheck(self, state: _BucketState) -> None:
        cfg = self.config
        drifted = False
        if state.num_since_decision >= cfg.window:
            median = statistics.median(state.samples[state.choice])
            drifted = abs(median - state.reference_ms) > cfg.drift_tolerance * state.reference_ms
        if drifted or state.num_since_decision >= cfg.recheck_interval:
            for samples in state.samples.values():
                samples.clear()
            state.num_round = {False: 0, True: 0}
            state.last_explored = None
            state.choice = None
            state.num_explore = cfg.num_explore_steps

    def crossover_tokens(self, kind: str) -> float:
        """Tokens per rank from which microbatching pays for ``kind``, as learned so far: the lowest
        bucket bound such that every decided bucket from there up chose microbatching. ``inf`` if
        the largest decided bucket chose off, ``nan`` if no bucket of ``kind`` has decided.

        Raises:
            ValueError: unknown ``kind``.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        decided = sorted(
            (b.log2_tokens, s.last_decision)
            for b, s in self._buckets.items()
            if b.kind == kind and s.last_decision is not None
        )
        if not decided:
            return math.nan
        crossover = math.inf
        for log2_tokens, use_ubatch in reversed(decided):
            if not use_ubatch:
                break
            crossover = float(1 << log2_tokens)
        return crossover

    def summary(self) -> dict[str, dict]:
        """Per bucket label: the decision (``on``/``off``/``exploring``), each arm's median ms."""
        out = {}
        for bucket in sorted(self._buckets, key=lambda b: (b.kind, b.log2_tokens)):
            s = self._buckets[bucket]
            medians = {
                ("on" if arm else "off"): statistics.median(v) if v else None
                for arm, v in s.samples.items()
            }
            state = "exploring" if s.choice is None else ("on" if s.choice else "off")
            out[bucket.label] = {"choice": state, "median_ms": medians}
        return out


def prior_from_table(table: Mapping) -> Callable[[Bucket], float | None]:
    """A ``prior`` from ``launch.plan --write-prior``'s JSON: ``{"decode": {"<log2_tokens>":
    speedup, ...}, "prefill": {...}}`` (speedups <= 0 and missing buckets: no prediction).

    Raises:
        ValueError: not that shape (a kind that is not a mapping of integers to numbers).
    """
    speedups: dict[Bucket, float] = {}
    for kind in KINDS:
        entries = table.get(kind, {}) if isinstance(table, Mapping) else None
        if not isinstance(entries, Mapping):
            raise ValueError(f"prior: {kind!r} must map log2 token buckets to speedups")
        for key, value in entries.items():
            try:
                log2_tokens, speedup = int(key), float(value)
            except (TypeError, ValueError):
                raise ValueError(f"prior: bad entry {kind}[{key!r}] = {value!r}") from None
            if speedup > 0 and log2_tokens >= 0:
                speedups[Bucket(kind=kind, log2_tokens=log2_tokens)] = speedup
    return speedups.get


def format_crossover(value: float) -> str:
    """``crossover_tokens`` for people: ``>= 64 tokens``, ``never`` (inf), ``unknown`` (nan)."""
    if math.isnan(value):
        return "unknown"
    if math.isinf(value):
        return "never"
    return f">= {int(value)} tokens"
