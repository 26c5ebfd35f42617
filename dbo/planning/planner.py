"""Predictions: step time with DBO off and on per N, speedups, crossovers and thresholds.

A cost model (``RooflineCostModel`` from presets, ``CalibratedCostModel`` from a timeline) gives
one ubatch's ``LayerCosts`` and the per-step work outside the MoE layers; ``schedule`` turns them
into step times. A step with N ubatches of a batch of T tokens costs::

    outside(T, N) + simulate_layers(layer_costs(T / N, N), N ubatches, the link)

and DBO off is N = 1. The speedup is off / on; a crossover is the smallest token count from which
the best N beats off by more than the adaptive policy's tie tolerance (1 %).

Asymmetric caution: a prediction carries an error bar (``DEFAULT_ERROR`` where nothing measured
it). Where the predicted speedup is within that error of 1.0x the planner cannot tell whether DBO
pays, and turning it on could lose up to the error bar, so the recommended threshold (``recommend``)
leaves DBO off there and the adaptive policy (threshold ``auto``) decides from measured steps.

``schedule`` names the overlap schedule: ``"ring"``, this engine's DBO (``simulate_layers``), or
``"sglang"``, SGLang's two-batch overlap (N = 2 only): its decode strategy
(``simulate_sglang_decode``); its prefill strategy yields after issuing the dispatch and the
combine, which is the ring with two ubatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dbo.planning.schedule import serial_layer_ms, simulate_layers, simulate_sglang_decode

TIE_TOLERANCE = 0.01  # dbo.AdaptivePolicyConfig.tie_tolerance: on must beat off by this
# The error bar of a predicted speedup where nothing measured it on the predicted link: 10 points
# (0.10 in speedup), the bound the comparisons in docs/planner.md hold on this machine (largest
# difference 9 points) and the bound the planner's sweep (launch.plan_sweep) checks.
DEFAULT_ERROR = 0.10
SCHEDULES = ("ring", "sglang")


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """One batch shape: per-layer C and M (ms, DBO off), step ms off and per N, speedups."""

    kind: str
    num_tokens: int
    compute_ms: float
    comm_ms: float
    step_ms_off: float
    step_ms_on: dict[int, float]

    @property
    def speedup(self) -> dict[int, float]:
        return {n: self.step_ms_off / ms for n, ms in self.step_ms_on.items()}

    @property
    def best_n(self) -> int:
        return min(self.step_ms_on, key=self.step_ms_on.get)

    @property
    def ideal_speedup(self) -> float:
        c, m = self.compute_ms, self.comm_ms
        return (c + m) / max(c, m, 1e-12)


def step_ms(
    model, link, kind: str, num_tokens: int, num_ubatches: int, *, schedule: str = "ring"
) -> float:
    """Predicted ms of one step of ``num_tokens`` tokens per device cut into ``num_ubatches``
    under ``schedule`` (see the module docstring).

    Raises:
        ValueError: ``num_tokens < num_ubatches`` (an empty ubatch), ``num_ubatches < 1``, an
            unknown schedule, or ``"sglang"`` with more than two ubatches.
    """
    if num_ubatches < 1 or num_tokens < num_ubatches:
        raise ValueError(f"cannot cut {num_tokens} tokens into {num_ubatches} non-empty ubatches")
    if schedule not in SCHEDULES or (schedule == "sglang" and num_ubatches > 2):
        raise ValueError(
            f"schedule {schedule!r} with {num_ubatches} ubatches: schedules are {SCHEDULES}, "
            f"and SGLang's two-batch overlap runs 2"
        )
    costs = model.layer_costs(kind, num_tokens / num_ubatches, num_ubatches=num_ubatches)
    if schedule == "sglang" and kind == "decode" and num_ubatches == 2:
        layers = simulate_sglang_decode(costs, num_layers=model.num_moe_layers, link=link)
    else:
        layers = simulate_layers(
            costs,
            num_layers=model.num_moe_layers,
            num_ubatches=num_ubatches,
            link=link,
            turn_ms=model.turn_ms(num_tokens / num_ubatches, num_ubatches),
            peer_arrival_ms=model.peer_arrival_ms(num_tokens, num_ubatches),
        )
    return model.outside_ms(kind, num_tokens, num_ubatches) + layers


def predict(
    model,
    link,
    kind: str,
    num_tokens: int,
    ubatch_counts: Sequence[int],
    *,
    schedule: str = "ring",
) -> Prediction:
    """``Prediction`` for one shape; N values that would leave a ubatch empty are skipped."""
    c, m = serial_layer_ms(model.layer_costs(kind, num_tokens), link)
    return Prediction(
        kind=kind,
        num_tokens=num_tokens,
        compute_ms=c,
        comm_ms=m,
        step_ms_off=step_ms(model, link, kind, num_tokens, 1),
        step_ms_on={
            n: step_ms(model, link, kind, num_tokens, n, schedule=schedule)
            for n in ubatch_counts
            if num_tokens >= n
        },
    )


def token_sweep(low: int = 1, high: int = 16384) -> list[int]:
    """Powers of two and their midpoints between ``low`` and ``high`` (inclusive)."""
    out, t = [], 1
    while t <= high:
        out += [v for v in (t, t + t // 2) if low <= v <= high and (v == t or t >= 2)]
        t *= 2
    return sorted(set(out))


def within_error(speedup: float, error: float) -> bool:
    """Whether a predicted ``speedup`` (off / on) is within ``error`` (in speedup, 0.10 = 10
    points) of 1.0x: the prediction cannot tell whether DBO pays."""
    return abs(speedup - 1.0) <= error


def _best_speedups(model, link, kind, ubatch_counts, tokens, schedule) -> dict[int, float]:
    """Token count -> the predicted speedup of its best N (0 where no N fits)."""
    out = {}
    for t in tokens:
        p = predict(model, link, kind, t, ubatch_counts, schedule=schedule)
        out[t] = p.speedup[p.best_n] if p.step_ms_on else 0.0
    return out


def _lowest_from_which(speedups: dict[int, float], margin: float) -> int | None:
    """The smallest token count from which every speedup beats 1 by more than ``margin``."""
    threshold = None
    for t in sorted(speedups, reverse=True):
        if speedups[t] <= 1 + margin:
            break
        threshold = t
    return threshold


def crossover(
    model,
    link,
    kind: str,
    ubatch_counts: Sequence[int],
    tokens: Sequence[int],
    *,
    schedule: str = "ring",
):
    """The smallest of ``tokens`` from which DBO with its best N beats off by more than the tie
    tolerance at every larger one; None if it does not at the largest."""
    speedups = _best_speedups(model, link, kind, ubatch_counts, tokens, schedule)
    return _lowest_from_which(speedups, TIE_TOLERANCE)


def recommend(
    model,
    link,
    ubatch_counts: Sequence[int],
    max_tokens: dict[str, int],
    *,
    schedule: str = "ring",
    error: float = DEFAULT_ERROR,
) -> dict:
    """Per kind, on a sweep of token counts up to ``max_tokens[kind]``: ``crossover``, where the
    predicted speedup passes the tie tolerance (None: never up to there); ``threshold``, the one
    to pass to the engine, where it clears ``error`` (in speedup, >= 0) as well, so that shapes
    predicted within the error of 1.0x stay below it (None: DBO stays off for that kind); and
    ``num_ubatches``, the best N at ``max_tokens[kind]`` (None where DBO never pays).

    Raises:
        ValueError: ``error < 0``.
    """
    if not error >= 0:
        raise ValueError(f"the error bar must be >= 0, got {error}")
    out = {}
    for kind, high in max_tokens.items():
        speedups = _best_speedups(model, link, kind, ubatch_counts, token_sweep(2, high), schedule)
        found = _lowest_from_which(speedups, TIE_TOLERANCE)
        best = predict(model, link, kind, high, ubatch_counts, schedule=schedule)
        out[kind] = {
            "crossover": found,
            "threshold": _lowest_from_which(speedups, max(TIE_TOLERANCE, error)),
            "num_ubatches": best.best_n if found is not None and best.step_ms_on else None,
        }
    return out


def bucket_prior(model, link, kind: str, log2_tokens: int, num_ubatches: int = 2) -> float:
    """Predicted speedup of N = ``num_ubatches`` for the adaptive policy's bucket
    ``[2**b, 2**(b+1))``, at its geometric middle; 0 if a ubatch would be empty."""
    t = max(int(round(2 ** (log2_tokens + 0.5))), 1)
    if t < num_ubatches:
        return 0.0
    return step_ms(model, link, kind, t, 1) / step_ms(model, link, kind, t, num_ubatches)
