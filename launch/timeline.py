"""Merge per-rank timelines, print overlap metrics, render a PNG: ``python -m launch.timeline DIR``.

``DIR`` holds the ``rank{r}.json`` traces an entry point wrote with ``--timeline-dir``; this writes
``DIR/timeline.json`` (Perfetto, overlapping events moved to extra lanes) and ``DIR/timeline.png``
and prints per-rank and overall metrics.
docs/profiling.md#merging-metrics-and-the-picture-launchtimeline."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dbo.timeline.metrics import StepMetrics, step_metrics, summarize
from dbo.timeline.trace import load_rank_spans, merge, overlapping_events


def format_metrics_table(rows: Sequence[tuple[str, dict]]) -> str:
    """A fixed-width table of summary metrics, one row per label."""
    cols = [
        ("steps", "num_steps", "{:d}"),
        ("step ms", "step_ms", "{:.2f}"),
        ("C ms", "compute_ms", "{:.2f}"),
        ("M ms", "comm_ms", "{:.2f}"),
        ("exposed ms", "exposed_comm_ms", "{:.2f}"),
        ("overlap", "overlap_ratio", "{:.2f}"),
        ("ideal x", "ideal_speedup", "{:.2f}"),
        ("achieved x", "achieved_speedup", "{:.2f}"),
        ("of ideal", "fraction_of_ideal", "{:.2f}"),
        ("baton us", "baton_pass_us_median", "{:.1f}"),
    ]
    header = f"{'':<18}" + "".join(f"{name:>11}" for name, _, _ in cols)
    lines = [header]
    for label, values in rows:
        lines.append(
            f"{label:<18}" + "".join(f"{fmt.format(values[key]):>11}" for _, key, fmt in cols)
        )
    return "\n".join(lines)


def metric_rows(metrics: Sequence[StepMetrics]) -> list[tuple[str, dict]]:
    """Summary rows: per rank (all steps, microbatched steps: one row per ubatch count when
    several ran, ``DBO N=3``) and over all ranks."""
    rows = []
    for rank in sorted({m.rank for m in metrics}):
        mine = [m for m in metrics if m.rank == rank]
        rows.append((f"rank {rank} all", summarize(mine).as_dict()))
        ubatched = [m for m in mine if m.is_ubatched]
        counts = sorted({m.num_ubatches for m in ubatched})
        if len(counts) == 1:
            rows.append((f"rank {rank} DBO", summarize(ubatched).as_dict()))
        for n in counts if len(counts) > 1 else ():
            same = [m for m in ubatched if m.num_ubatches == n]
            rows.append((f"rank {rank} DBO N={n}", summarize(same).as_dict()))
    rows.append(("overall", summarize(metrics).as_dict()))
    return rows


def parse_steps(text: str) -> list[int]:
    """``"3"``, ``"2-5"`` or ``"1,4,7"`` -> step indices.

    Raises:
        ValueError: naming the malformed part.
    """
    steps: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            steps += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"--steps {text!r}: {part!r} is not N or N-M") from None
    return steps


def default_steps(metrics: Sequence[StepMetrics]) -> list[int]:
    """The microbatched step with the median step time (else the median step), as a 1-list."""
    candidates = [m for m in metrics if m.rank == metrics[0].rank and m.is_ubatched] or [
        m for m in metrics if m.rank == metrics[0].rank
    ]
    ordered = sorted(candidates, key=lambda m: m.step_ms)
    return [ordered[len(ordered) // 2].step] if ordered else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="folder with rank<r>.json files (--timeline-dir)")
    parser.add_argument("--output", default=None, help="merged trace (default DIR/timeline.json)")
    parser.add_argument("--png", default=None, help="picture (default DIR/timeline.png)")
    parser.add_argument(
        "--steps",
        default=None,
        help="steps to draw: N, N-M or N,M,... (default: a median DBO step)",
    )
    parser.add_argument("--per-step", action="store_true", help="also print every step's metrics")
    ns = parser.parse_args(argv)
    try:
        spans = load_rank_spans(ns.directory)
        metrics = step_metrics(spans)
        steps = parse_steps(ns.steps) if ns.steps else default_steps(metrics)
    except (OSError, ValueError) as e:
        print(f"launch.timeline: error: {e}", file=sys.stderr)
        return 2
    trace = merge(spans)
    bad = overlapping_events(trace)
    if bad:  # cannot happen after assign_lanes; checked because Perfetto would drop events
        print(
            f"launch.timeline: error: {len(bad)} overlapping events on one track", file=sys.stderr
        )
        return 1
    out = Path(ns.output or Path(ns.directory) / "timeline.json")
    out.write_text(json.dumps(trace), encoding="utf-8")
    num_tracks = len({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"})
    print(f"wrote {out}: {len(spans)} events on {num_tracks} tracks, no overlaps on any track")
    if ns.per_step:
        for m in metrics:
            print(json.dumps(m.as_dict()))
    print(format_metrics_table(metric_rows(metrics)))
    from dbo.timeline.plot import plot_steps

    png = Path(ns.png or Path(ns.directory) / "timeline.png")
    plot_steps(spans, steps, png)
    print(f"wrote {png} (steps {steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
