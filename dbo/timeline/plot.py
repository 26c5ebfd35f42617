"""Draw chosen engine steps of a timeline as a PNG: a lane per rank and track (ubatch x kind),
compute (host and device) and communication in different colours (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dbo.timeline.metrics import Span
from dbo.timeline.recorder import CAT_BATON, CAT_COMM, CAT_COMPUTE, CAT_GPU, CAT_STEP, CAT_WAIT

COLOURS = {
    CAT_COMPUTE: "#1f77b4",  # blue
    CAT_GPU: "#9467bd",  # purple: compute as the device ran it, on its own gpu lanes
    CAT_COMM: "#ff7f0e",  # orange
    CAT_WAIT: "#d62728",  # red
    CAT_BATON: "#2ca02c",  # green
    CAT_STEP: "#c7c7c7",  # light grey
    "window": "#7f7f7f",  # dark grey: a combine issued, its result not yet taken (shared experts)
}


def plot_steps(spans: Sequence[Span], steps: Sequence[int], path: str | Path) -> None:
    """Render ``steps`` (engine step indices) of every rank to ``path``; x = ms from the first
    chosen step's start on rank 0's clock (shared by ranks on one host).

    Raises:
        ValueError: if none of ``steps`` was recorded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from dbo.timeline.tracks import track_order

    wanted = set(steps)
    windows = [
        (s.rank, s.start_ns, s.end_ns)
        for s in spans
        if s.cat == CAT_STEP and int(s.args.get("step", -1)) in wanted
    ]
    if not windows:
        raise ValueError(f"steps {sorted(wanted)} are not in the timeline")
    origin = min(start for _, start, _ in windows)

    def in_window(span: Span) -> bool:
        return any(
            r == span.rank and span.end_ns > lo and span.start_ns < hi for r, lo, hi in windows
        )

    chosen = [s for s in spans if in_window(s)]
    lanes = sorted({(s.rank, s.track) for s in chosen}, key=lambda k: (k[0], track_order(k[1])))
    row = {lane: i for i, lane in enumerate(lanes)}
    drawn = {s.cat for s in chosen}
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(lanes) + 1.5))
    for s in chosen:
        y = row[(s.rank, s.track)]
        height = 0.8 if s.cat != CAT_STEP else 0.4
        ax.broken_barh(
            [((s.start_ns - origin) / 1e6, max((s.end_ns - s.start_ns) / 1e6, 1e-4))],
            (y - height / 2, height),
            facecolors=COLOURS.get(s.cat, "#7f7f7f"),
            edgecolor="none",
        )
    ax.set_yticks(range(len(lanes)), [f"rank {r}  {t}" for r, t in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"steps {sorted(wanted)}")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k in drawn],
        loc="upper right",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
