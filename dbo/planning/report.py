"""What ``launch.plan`` prints and writes: the table, sensitivity, predicted-vs-measured, the
adaptive policy's prior and the PNG."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from dbo.planning.calibration import read_records
from dbo.planning.links import LinkModel, from_gbps
from dbo.planning.planner import (
    DEFAULT_ERROR,
    TIE_TOLERANCE,
    Prediction,
    bucket_prior,
    predict,
    within_error,
)
from distributed.link_emulation import LinkSpec

PRIOR_FORMAT = "moe-dbo adaptive prior v1"
MAX_PRIOR_LOG2 = 16  # buckets 2**0 .. 2**16 tokens


def advice(prediction: Prediction, error: float = DEFAULT_ERROR) -> str:
    """What to do at one shape: ``N=<best>`` where the best N's predicted speedup beats 1.0x by
    more than ``error`` (and the tie tolerance), ``~1: off`` where it is within ``error`` of 1.0x
    (leave DBO off; the adaptive policy decides), ``off`` where DBO is predicted to lose."""
    if not prediction.step_ms_on:
        return "off"
    speedup = prediction.speedup[prediction.best_n]
    if speedup > 1 + max(error, TIE_TOLERANCE):
        return f"N={prediction.best_n}"
    return "~1: off" if within_error(speedup, error) else "off"


def caution_note(predictions: Sequence[Prediction], error: float = DEFAULT_ERROR) -> str | None:
    """The line that names the shapes predicted within ``error`` of 1.0x; None if none."""
    near = [
        f"{p.kind}:{p.num_tokens} ({p.speedup[p.best_n]:.2f}x)"
        for p in predictions
        if advice(p, error) == "~1: off"
    ]
    if not near:
        return None
    return (
        f"within the error (±{100 * error:.0f} points) of 1.0x: {', '.join(near)}: leave DBO off "
        "(the adaptive policy decides: thresholds auto)"
    )


def format_table(
    predictions: Sequence[Prediction],
    ubatch_counts: Sequence[int],
    error: float = DEFAULT_ERROR,
) -> str:
    """One row per shape: C and M per layer (DBO off), ideal, step ms off and per N, speedups,
    and ``advice`` under the error bar ``error`` (in speedup)."""
    ns = list(ubatch_counts)
    head = ["batch", "C ms/layer", "M ms/layer", "ideal", "off ms"]
    head += [f"N={n} ms" for n in ns] + [f"N={n} x" for n in ns] + ["best"]
    rows = [head]
    for p in predictions:
        row = [f"{p.kind}:{p.num_tokens}", f"{p.compute_ms:.3f}", f"{p.comm_ms:.3f}"]
        row += [f"{p.ideal_speedup:.2f}", f"{p.step_ms_off:.2f}"]
        row += [f"{p.step_ms_on[n]:.2f}" if n in p.step_ms_on else "-" for n in ns]
        row += [f"{p.speedup[n]:.3f}" if n in p.speedup else "-" for n in ns]
        row.append(advice(p, error))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _perturbed(model, link, name: str, factor: float):
    """``(model, link)`` with one input scaled by ``factor``; None if the model lacks it."""
    if name == "link bandwidth":
        return model, link.scaled(bandwidth=factor)
    if name == "link latency":
        return model, link.scaled(latency=factor)
    device = getattr(model, "device", None)
    if device is None:
        return None
    field = {
        "device FLOP/s": "peak_tflops",
        "memory bandwidth": "mem_tbps",
        "kernel floor": "kernel_us",
    }
    value = getattr(device, field[name])
    value = {k: v * factor for k, v in value.items()} if isinstance(value, dict) else value * factor
    clone = model.__class__.__new__(model.__class__)
    clone.__dict__.update(model.__dict__)
    clone.device = replace(device, **{field[name]: value})
    return clone, link


SENSITIVITY_INPUTS = (
    "link bandwidth",
    "link latency",
    "device FLOP/s",
    "memory bandwidth",
    "kernel floor",
)


def sensitivity(
    model,
    link,
    kind: str,
    num_tokens: int,
    num_ubatches: int,
    factor: float = 1.25,
    *,
    schedule: str = "ring",
):
    """Per input, the predicted speedup with it scaled by ``1/factor`` and ``factor``; and the
    input that moves the speedup most. Returns (base, {input: (low, high)}, most)."""

    def speedup(model, link) -> float:
        p = predict(model, link, kind, num_tokens, [num_ubatches], schedule=schedule)
        return p.speedup[num_ubatches]

    base = speedup(model, link)
    out = {}
    for name in SENSITIVITY_INPUTS:
        pair = []
        for f in (1 / factor, factor):
            scaled = _perturbed(model, link, name, f)
            if scaled is None:
                break
            pair.append(speedup(*scaled))
        if pair:
            out[name] = tuple(pair)
    most = max(out, key=lambda k: max(abs(v - base) for v in out[k]))
    return base, out, most


def format_sensitivity(kind, num_tokens, num_ubatches, result, factor: float = 1.25) -> str:
    base, out, most = result
    parts = [f"{k} {lo:.2f}..{hi:.2f}" for k, (lo, hi) in out.items()]
    return (
        f"sensitivity ({kind}:{num_tokens}, N={num_ubatches}, speedup {base:.2f}; "
        f"each input /{factor} "
        f"and x{factor}): " + ", ".join(parts) + f"; matters most: {most}"
    )


# Transfers / compute per ubatch and layer (``CalibratedCostModel.comm_to_compute``) where the
# ranks run apart between transfers (near balance), and from where every transfer holds them
# together (link-bound); read off the calibrations in docs/planner.md, a judgment, not a constant
# of nature.
NEAR_BALANCE = (0.8, 1.4)


def drift_unmeasured(model, link, kind: str, tokens: int) -> tuple[float, float] | None:
    """``(calibration run's, link's)`` transfers / compute per ubatch and layer of the shape when
    ``link`` runs it near balance and the calibration run's link ran it link-bound (the ranks'
    drift drawn for it was measured where they meet at every transfer, so its predicted speedup
    may be too high); None otherwise, or when ``model`` is not calibrated."""
    if not hasattr(model, "comm_to_compute"):
        return None
    target, calibrated = (
        model.comm_to_compute(kind, tokens, link),
        model.comm_to_compute(kind, tokens),
    )
    low, high = NEAR_BALANCE
    return (calibrated, target) if low <= target <= high < calibrated else None


def drift_note(flagged: Sequence[tuple[str, tuple[float, float]]]) -> str | None:
    """The line that names ``flagged`` shapes (``(label, drift_unmeasured(...))``); None if none."""
    if not flagged:
        return None
    shapes = ", ".join(f"{label} ({a:.2f} -> {b:.2f})" for label, (a, b) in flagged)
    return (
        f"drift not measured near balance: {shapes} (transfers / compute per ubatch and layer, "
        "calibration run -> predicted link): the calibration ran these link-bound, where the "
        "ranks meet at every transfer; near balance they drift further apart, so these "
        "predictions may be too high (calibrate on a link that runs them near balance: "
        "docs/planner.md#calibrated-on-this-machine)"
    )


def link_of_record(record: dict, fallback: LinkModel) -> LinkModel:
    """The link a ``launch.bench`` record ran on (its ``emulate_link``), else ``fallback``."""
    spec = record.get("emulate_link")
    if not spec:
        return fallback
    parsed = LinkSpec.parse(spec)
    return from_gbps(
        parsed.latency_us, parsed.gbps, name=spec, source="the record's --emulate-link"
    )


def compare(model, link, results_paths: Sequence[str]) -> list[dict]:
    """Predicted vs measured DBO speedup (N = 2) per (link, batch shape) over one or more
    ``launch.bench --output`` files: the measured value is the median over the files of each
    run's ratio of median step times (``fastest``: of fastest step times, what a loaded machine
    least distorts); a record whose DBO arm did not microbatch is left out. One dict per (link,
    batch): ``link`` (its name), ``link_model`` (the ``LinkModel`` predicted), ``batch``, ``kind``,
    ``num_tokens``, ``measured``, ``runs`` (each run's speedup, sorted), ``predicted``, ``fastest``,
    ``unmeasured_drift`` (``drift_unmeasured``).

    Raises:
        ValueError: an unreadable file or a record without the expected fields.
    """
    measured: dict[tuple[str, str], list[float]] = {}
    fastest: dict[tuple[str, str], list[float]] = {}
    shapes: dict[tuple[str, str], tuple[LinkModel, str, int]] = {}
    for path in results_paths:
        for r in read_records(path, option="--compare"):
            if not r.get("dbo_engaged", True):
                continue
            run_link = link_of_record(r, link)
            if run_link is not link and hasattr(model, "adapt_link"):
                run_link = model.adapt_link(run_link)
            key = (run_link.name, r["batch"])
            measured.setdefault(key, []).append(float(r["speedup"]))
            if r.get("step_ms_on_min"):
                fastest.setdefault(key, []).append(r["step_ms_off_min"] / r["step_ms_on_min"])
            shapes[key] = (run_link, r["batch_kind"], int(r["num_tokens_per_rank"]))
    rows = []
    for key, values in measured.items():
        run_link, kind, tokens = shapes[key]
        p = predict(model, run_link, kind, tokens, [2])
        rows.append(
            {
                "unmeasured_drift": drift_unmeasured(model, run_link, kind, tokens),
                "link": key[0],
                "link_model": run_link,
                "batch": key[1],
                "kind": kind,
                "num_tokens": tokens,
                "measured": statistics.median(values),
                "runs": sorted(values),
                "predicted": p.speedup.get(2, float("nan")),
                "fastest": statistics.median(fastest.get(key) or [float("nan")]),
            }
        )
    return rows


def format_compare(rows: list[dict]) -> str:
    lines = [
        "| link | batch | measured (runs) | fastest steps | predicted | difference (points) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        diff = 100 * (r["predicted"] - r["measured"])
        runs = ", ".join(f"{v:.2f}" for v in r["runs"])
        mark = " *" if r.get("unmeasured_drift") else ""
        lines.append(
            f"| {r['link']} | {r['batch']} | {r['measured']:.2f}x ({runs}) | {r['fastest']:.2f}x | "
            f"{r['predicted']:.2f}x | {diff:+.0f}{mark} |"
        )
    worst = max((abs(r["predicted"] - r["measured"]) for r in rows), default=0.0)
    text = "\n".join(lines) + f"\nlargest difference: {100 * worst:.0f} points"
    note = drift_note(
        [
            (f"{r['link']} {r['batch']}", r["unmeasured_drift"])
            for r in rows
            if r.get("unmeasured_drift")
        ]
    )
    return text + (f"\n{note}" if note else "")


def measured_error(rows: Sequence[dict], floor: float = DEFAULT_ERROR) -> float:
    """The error bar (in speedup) of the predictions: the largest difference ``compare`` measured
    in ``rows``, and never below ``floor`` (what nothing measured is assumed to be)."""
    return max([floor, *(abs(r["predicted"] - r["measured"]) for r in rows)])


def prior_table(model, link, num_ubatches: int = 2, error: float = DEFAULT_ERROR) -> dict:
    """The adaptive policy's prior: predicted speedup per (kind, log2 bucket) for N = 2. Buckets
    whose prediction is within ``error`` (in speedup) of 1.0x are left out: no prediction there,
    so the policy explores them fully, as the recommended thresholds leave DBO off there."""
    table: dict = {"format": PRIOR_FORMAT, "num_ubatches": num_ubatches, "error": error}
    for kind in ("decode", "prefill"):
        speedups = {
            b: bucket_prior(model, link, kind, b, num_ubatches) for b in range(MAX_PRIOR_LOG2 + 1)
        }
        table[kind] = {
            str(b): round(v, 4) for b, v in speedups.items() if not within_error(v, error)
        }
    return table


def draw_png(path: str, curves: dict[str, list[tuple[int, float]]], title: str) -> None:
    """Speedup against tokens per device, one line per (kind, N); 1.0 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, points in curves.items():
        ax.plot([t for t, _ in points], [s for _, s in points], marker=".", label=label)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per device per step")
    ax.set_ylabel("predicted DBO speedup (off / on)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
