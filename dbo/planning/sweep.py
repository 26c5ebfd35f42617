"""The planner checked on links it was not calibrated on (``python -m launch.plan_sweep``): the
grid of links, one row per (link, batch shape) with the measured spread, the markdown table and
the summary line. The bench runs themselves and their predicted duration: ``launch.plan_sweep``.

A shape counts as predicted when the prediction is within ``WITHIN_POINTS`` of the median
measured speedup, and as unsafe when the planner's recommended thresholds (with their error bar,
``planner.recommend``) turn DBO on there and DBO measured below ``SAFE_SPEEDUP``: the two bounds
of the planner's acceptance (docs/planner.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dbo.planning import planner
from distributed.link_emulation import LinkSpec

WITHIN_POINTS = 10.0  # points of speedup (0.10) between predicted and median measured
SAFE_SPEEDUP = 0.95  # DBO measured below this where the planner turns it on: unsafe


def parse_factors(text: str, option: str) -> tuple[float, ...]:
    """``"0.1,1,10"`` -> ``(0.1, 1.0, 10.0)``.

    Raises:
        ValueError: naming ``option`` and the text, for an empty list, a non-number or a factor
            <= 0 or not finite.
    """
    try:
        factors = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated numbers") from None
    if not factors or not all(math.isfinite(f) and f > 0 for f in factors):
        raise ValueError(f"{option} {text!r}: expected finite factors > 0")
    return factors


def grid_links(
    calibration: LinkSpec, latency_factors: Sequence[float], gbps_factors: Sequence[float]
) -> list[LinkSpec]:
    """Every (latency x a, bandwidth x b) around ``calibration``, latency-major, each once."""
    links = [
        LinkSpec(latency_us=calibration.latency_us * a, gbps=calibration.gbps * b)
        for a in latency_factors
        for b in gbps_factors
    ]
    return list(dict.fromkeys(links))


def link_arg(spec: LinkSpec) -> str:
    """``spec`` as ``--emulate-link`` takes it (``latency_us=5,gbps=0.05``)."""
    return f"latency_us={spec.latency_us:.6g},gbps={spec.gbps:.6g}"


def link_label(name: str) -> str:
    """A ``launch.bench`` record's ``emulate_link`` for a table (``5 µs, 0.05 Gbit/s``)."""
    try:
        spec = LinkSpec.parse(name)
    except ValueError:
        return name
    return f"{spec.latency_us:.6g} µs, {spec.gbps:.6g} Gbit/s"


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepRow:
    """One (link, batch shape) of the sweep: ``runs``, each run's measured speedup (DBO off / on,
    ratio of median step times); ``predicted`` (N = 2); ``recommended``, whether the planner's
    recommended threshold turns DBO on at this shape; ``near_one``, whether the prediction is
    within the planner's error bar of 1.0x (left off: the adaptive policy decides)."""

    link: str
    batch: str
    runs: tuple[float, ...]
    predicted: float
    recommended: bool
    near_one: bool = False

    @property
    def measured(self) -> float:
        """The median over the runs."""
        return statistics.median(self.runs)

    @property
    def spread_points(self) -> float:
        """Max - min of the runs, in points of speedup (0 for one run)."""
        return 100 * (max(self.runs) - min(self.runs))

    @property
    def difference_points(self) -> float:
        """Predicted - median measured, in points of speedup."""
        return 100 * (self.predicted - self.measured)

    @property
    def is_within(self) -> bool:
        # rounded: 1.10 - 1.00 is 10.000000000000009 points in floating point
        return abs(round(self.difference_points, 6)) <= WITHIN_POINTS

    @property
    def is_unsafe(self) -> bool:
        return self.recommended and self.measured < SAFE_SPEEDUP


def sweep_rows(model, compared: Sequence[dict], error: float) -> list[SweepRow]:
    """``SweepRow``s from ``report.compare``'s rows: per link, the planner's recommended
    thresholds (``planner.recommend`` with ``error``, in speedup, N = 2) up to that link's
    largest shape of each kind decide ``recommended``."""
    by_link: dict[str, list[dict]] = {}
    for row in compared:
        by_link.setdefault(row["link"], []).append(row)
    out = []
    for link, rows in by_link.items():
        highs: dict[str, int] = {}
        for r in rows:
            highs[r["kind"]] = max(highs.get(r["kind"], 0), r["num_tokens"])
        rec = planner.recommend(model, rows[0]["link_model"], [2], highs, error=error)
        for r in rows:
            threshold = rec[r["kind"]]["threshold"]
            out.append(
                SweepRow(
                    link=link,
                    batch=r["batch"],
                    runs=tuple(r["runs"]),
                    predicted=r["predicted"],
                    recommended=threshold is not None and r["num_tokens"] >= threshold,
                    near_one=planner.within_error(r["predicted"], error),
                )
            )
    return out


def _planner_cell(row: SweepRow) -> str:
    if row.recommended:
        return "DBO on"
    return "off (within the error of 1.0x)" if row.near_one else "off"


def format_sweep(rows: Sequence[SweepRow], calibration: str | None = None) -> str:
    """The markdown table: per row the median measured speedup and the runs' range, the
    prediction, the difference and the spread beside it (points), the planner's recommendation
    and whether it is safe; the row of the ``calibration`` link (an ``emulate_link``) marked."""
    lines = [
        "| link | batch | measured: median (runs' range) | predicted | difference (points) | "
        "spread (points) | planner | safe |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        link = link_label(r.link) + (" (calibration)" if r.link == calibration else "")
        measured = f"{r.measured:.2f}x ({min(r.runs):.2f}..{max(r.runs):.2f})"
        safe = "no" if r.is_unsafe else "yes"
        lines.append(
            f"| {link} | {r.batch} | {measured} | {r.predicted:.2f}x | "
            f"{r.difference_points:+.0f} | {r.spread_points:.0f} | {_planner_cell(r)} | {safe} |"
        )
    return "\n".join(lines)


def summary(rows: Sequence[SweepRow]) -> str:
    """``N of M shapes within 10 points; K shapes where the planner recommends DBO and DBO
    measured below 0.95x`` (and the share within, in percent)."""
    within = sum(r.is_within for r in rows)
    unsafe = sum(r.is_unsafe for r in rows)
    share = f" ({100 * within / len(rows):.0f} %)" if rows else ""
    return (
        f"{within} of {len(rows)} shapes within {WITHIN_POINTS:g} points{share}; {unsafe} shapes "
        f"where the planner recommends DBO and DBO measured below {SAFE_SPEEDUP:g}x"
    )
