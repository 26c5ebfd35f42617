"""Records, table and JSON of ``launch.bench`` (pure functions of the per-step metrics)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from launch.benchmarks.workload import BatchSpec


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def make_record(
    spec: BatchSpec, steps_per_rank: Sequence[Sequence[dict]], *, span_cost_ns: float, meta: dict
) -> dict:
    """One result record of a batch shape.

    Args:
        steps_per_rank: per rank, its step dicts (``StepMetrics`` fields + ``arm`` ("off", "on",
            "adaptive") + ``dbo`` + ``exploring`` + ``num_spans``, optionally ``num_ubatches``:
            the ubatches the step ran) in the same order on every rank.
        span_cost_ns: cost of recording one span (for the timeline overhead estimate).
        meta: run description copied into the record.

    Raises:
        ValueError: if the ranks measured different numbers of steps.
    """
    num_steps = {len(steps) for steps in steps_per_rank}
    if len(num_steps) != 1:
        raise ValueError(f"ranks measured different numbers of steps: {sorted(num_steps)}")
    # one entry per measured step: the same step on every rank
    aligned = list(zip(*steps_per_rank, strict=True))
    off, on = _per_arm(aligned, "off"), _per_arm(aligned, "on")
    step_off, step_on = _slowest(off), _slowest(on)
    adaptive, exploring = _per_arm(aligned, "adaptive"), _per_arm(aligned, "adaptive", True)
    return {
        "batch": spec.label,
        "batch_kind": spec.kind,
        "num_tokens_per_rank": spec.num_tokens_per_rank,
        **_step_time_fields(step_off, step_on),
        **_overlap_fields(off, on, step_off, step_on),
        **_engaged_fields(on),
        **_overhead_fields(aligned, on, span_cost_ns),
        "reps": len(on),
        **adaptive_fields(adaptive, exploring, off, on, step_off, step_on),
        "steps": _step_sequence(aligned),
        **{k: v for k, v in meta.items() if k != "reps"},
    }


def _step_sequence(aligned) -> list[dict]:
    """Every kept step in the order it ran: ``arm``, ``round`` (None for warm-up and exploration
    steps), ``exploring``, ``is_ubatched`` and ``step_ms`` (the slowest rank's), so an analysis
    can see what ran before a step (a step's after-effect on the next one)."""
    return [
        {
            "arm": ranks[0]["arm"],
            "round": ranks[0].get("round"),
            "exploring": ranks[0].get("exploring", False),
            "is_ubatched": ranks[0]["is_ubatched"],
            "step_ms": max(r["step_ms"] for r in ranks),
        }
        for ranks in aligned
    ]


def _per_arm(aligned, arm: str, exploring: bool = False) -> list[tuple[dict, ...]]:
    """The aligned steps (one tuple of rank dicts each) of ``arm``, exploring or not."""
    return [
        ranks
        for ranks in aligned
        if ranks[0]["arm"] == arm and ranks[0].get("exploring", False) is exploring
    ]


def _slowest(steps) -> list[float]:
    """Per step, the slowest rank's ``step_ms`` (the step ends when its last rank does)."""
    return [max(r["step_ms"] for r in ranks) for ranks in steps]


def _mean_of(steps, key: str) -> list[float]:
    """Per step, the mean over ranks of ``key``."""
    return [statistics.fmean(r[key] for r in ranks) for ranks in steps]


def _step_time_fields(step_off: list[float], step_on: list[float]) -> dict:
    """``step_ms_{off,on}`` (median, min, max of the slowest rank) and ``speedup`` = off / on."""
    return {
        "step_ms_off": _median(step_off),
        "step_ms_off_min": min(step_off),
        "step_ms_off_max": max(step_off),
        "step_ms_on": _median(step_on),
        "step_ms_on_min": min(step_on),
        "step_ms_on_max": max(step_on),
        "speedup": _speedup(step_off, step_on),
    }


def _speedup(step_off: list[float], step_on: list[float]) -> float:
    """Median off step over median on step (> 1: DBO on is faster)."""
    return _median(step_off) / max(_median(step_on), 1e-9)


def _overlap_fields(off, on, step_off: list[float], step_on: list[float]) -> dict:
    """Compute / communication split of the off steps, exposed communication and overlap ratio
    per arm, and the speedup a perfect overlap would give (``ideal_speedup`` =
    (compute + comm) / max(compute, comm)) with the fraction of it reached."""
    compute_ms, comm_ms = _median(_mean_of(off, "compute_ms")), _median(_mean_of(off, "comm_ms"))
    ideal_speedup = (compute_ms + comm_ms) / max(compute_ms, comm_ms, 1e-9)
    return {
        "compute_ms": compute_ms,
        "comm_ms": comm_ms,
        "exposed_comm_ms_off": _median(_mean_of(off, "exposed_comm_ms")),
        "exposed_comm_ms_on": _median(_mean_of(on, "exposed_comm_ms")),
        "overlap_ratio": _median(_mean_of(on, "overlap_ratio")),
        "overlap_ratio_off": _median(_mean_of(off, "overlap_ratio")),
        "ideal_speedup": ideal_speedup,
        "fraction_of_ideal_speedup": _speedup(step_off, step_on) / ideal_speedup,
    }


def _overhead_fields(aligned, on, span_cost_ns: float) -> dict:
    """``baton_pass_us_median`` of the on steps that passed the baton and
    ``timeline_overhead_pct``: the median share of a step spent recording its spans."""
    batons = [r["baton_pass_us_median"] for ranks in on for r in ranks if r["num_baton_passes"]]
    overhead = [
        100 * r["num_spans"] * span_cost_ns / 1e6 / r["step_ms"]
        for ranks in aligned
        for r in ranks
        if r["step_ms"] > 0
    ]
    return {"baton_pass_us_median": _median(batons), "timeline_overhead_pct": _median(overhead)}


def _engaged_fields(on) -> dict:
    """``dbo_engaged``: every on step microbatched; ``ubatches_run``: the ubatch counts the on
    steps ran (fewer than asked where a ubatch would have been empty)."""
    return {
        "dbo_engaged": all(r["is_ubatched"] for ranks in on for r in ranks),
        "ubatches_run": sorted({r.get("num_ubatches", 2) for ranks in on for r in ranks}),
    }


def _paired_ratio(measured, best) -> float:
    """Median over rounds of adaptive / ``best`` arm's step in the same round (pairing cancels
    the machine's slow swings in speed, which a ratio of medians does not); nan without rounds."""
    by_round = {ranks[0].get("round"): max(r["step_ms"] for r in ranks) for ranks in best}
    ratios = [
        max(r["step_ms"] for r in ranks) / by_round[ranks[0].get("round")]
        for ranks in measured
        if by_round.get(ranks[0].get("round"), 0) > 0
    ]
    return statistics.median(ratios) if ratios else float("nan")


def adaptive_fields(measured, exploring, off, on, step_off, step_on) -> dict:
    """The adaptive arm's fields: ``step_ms_adaptive`` (median of its steps after exploration),
    ``adaptive_choice`` ("on" / "off" / "mixed": whether those steps microbatched),
    ``adaptive_vs_best`` = step_ms_adaptive / min(step_ms_on, step_ms_off), ``best_static_arm``
    (which of on / off had the lower median here), ``adaptive_vs_best_paired`` (the median of
    per-round ratios adaptive / best static arm), and its exploration
    steps apart (``adaptive_exploration_steps``, ``step_ms_adaptive_exploring``). Empty without
    the arm."""
    if not measured and not exploring:
        return {}
    step_ms = _slowest(measured)
    ubatched = {ranks[0]["is_ubatched"] for ranks in measured}
    choice = "mixed" if len(ubatched) > 1 else ("on" if ubatched == {True} else "off")
    best = min(_median(step_off), _median(step_on))
    best_arm = "on" if _median(step_on) < _median(step_off) else "off"
    return {
        "step_ms_adaptive": _median(step_ms),
        "step_ms_adaptive_min": min(step_ms, default=0.0),
        "step_ms_adaptive_max": max(step_ms, default=0.0),
        "adaptive_choice": choice if measured else "exploring",
        "best_static_arm": best_arm,  # the faster static arm in this run (noise included)
        "adaptive_vs_best": _median(step_ms) / best if measured and best > 0 else float("nan"),
        "adaptive_vs_best_paired": _paired_ratio(measured, on if best_arm == "on" else off),
        "adaptive_reps": len(measured),
        "adaptive_exploration_steps": len(exploring),
        "step_ms_adaptive_exploring": _median(_slowest(exploring)),
    }


def format_table(records: Sequence[dict]) -> str:
    """Fixed-width table of the records (step times: median [min-max] of the slowest rank)."""
    header = (
        f"{'batch':<14}{'N':>3}{'off ms':>28}{'on ms':>28}{'speedup':>9}{'C ms':>8}{'M ms':>8}"
        f"{'exp off':>9}{'exp on':>8}{'overlap':>8}{'ideal x':>8}{'frac':>6}{'DBO':>5}"
        f"{'baton us':>9}{'tl %':>6}"
    )
    lines = [header]
    for r in records:
        off = f"{r['step_ms_off']:.2f} [{r['step_ms_off_min']:.2f}-{r['step_ms_off_max']:.2f}]"
        on = f"{r['step_ms_on']:.2f} [{r['step_ms_on_min']:.2f}-{r['step_ms_on_max']:.2f}]"
        asked = r.get("ubatch_size", 2)
        # "*": some on steps ran fewer ubatches than asked (a ubatch would have been empty)
        count = f"{asked}{'*' if r.get('ubatches_run', [asked]) != [asked] else ''}"
        lines.append(
            f"{r['batch']:<14}{count:>3}{off:>28}{on:>28}{r['speedup']:>8.2f}x"
            f"{r['compute_ms']:>8.2f}{r['comm_ms']:>8.2f}{r['exposed_comm_ms_off']:>9.2f}"
            f"{r['exposed_comm_ms_on']:>8.2f}{r['overlap_ratio']:>8.2f}{r['ideal_speedup']:>8.2f}"
            f"{r['fraction_of_ideal_speedup']:>6.2f}{'yes' if r['dbo_engaged'] else 'no':>5}"
            f"{r['baton_pass_us_median']:>9.1f}{r['timeline_overhead_pct']:>6.2f}"
        )
    if any("step_ms_adaptive" in r for r in records):
        lines += ["", format_adaptive_table(records)]
    return "\n".join(lines)


def format_adaptive_table(records: Sequence[dict]) -> str:
    """The adaptive arm against the better static arm (step times: median of the slowest rank)."""
    header = (
        f"{'batch':<14}{'off ms':>10}{'on ms':>10}{'adaptive ms':>30}{'choice':>10}{'best':>6}"
        f"{'ad/best':>9}{'paired':>8}{'explore steps':>15}{'explore ms':>12}"
    )
    lines = [header]
    for r in records:
        if "step_ms_adaptive" not in r:
            continue
        ad = (
            f"{r['step_ms_adaptive']:.2f} [{r['step_ms_adaptive_min']:.2f}-"
            f"{r['step_ms_adaptive_max']:.2f}]"
        )
        lines.append(
            f"{r['batch']:<14}{r['step_ms_off']:>10.2f}{r['step_ms_on']:>10.2f}{ad:>30}"
            f"{r['adaptive_choice']:>10}{r['best_static_arm']:>6}{r['adaptive_vs_best']:>8.3f}x"
            f"{r['adaptive_vs_best_paired']:>7.3f}x"
            f"{r['adaptive_exploration_steps']:>15}{r['step_ms_adaptive_exploring']:>12.2f}"
        )
    return "\n".join(lines)


def write_records(records: Sequence[dict], path: str | Path) -> None:
    """Write the records as a JSON list (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(records), indent=2) + "\n", encoding="utf-8")
