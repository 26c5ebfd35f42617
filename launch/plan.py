"""Will DBO pay? Predict DBO's speedup per batch shape and N: ``python -m launch.plan``.

From presets (a model, a device, a link, an EP size) or from a ``launch.bench --timeline-dir`` run
(``--calibrate DIR``) it predicts per MoE layer compute and communication, the step time with DBO
off and with N ubatches, the crossovers and the thresholds to pass. docs/planner.md."""

from __future__ import annotations

import argparse
import json
import sys

from launch.engine.arg_utils import OneLineErrorParser, bounded_number

PROG = "launch.plan"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    _add_deployment_args(parser.add_argument)
    _add_workload_args(parser.add_argument)
    _add_calibration_args(parser.add_argument)
    return parser


def _add_deployment_args(add) -> None:
    """Model, device, link and EP size."""
    add(
        "--model",
        default="DeepSeek-V3",
        help="preset (DeepSeek-V3, Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B) or a "
        "config.json path",
    )
    add("--device", default="h100-sxm", help="h100-sxm, h800-sxm, h200 or this-machine (measured)")
    add(
        "--link",
        default="deepep-ll",
        choices=("deepep-ll", "deepep-ht"),
        help="DeepEP table preset",
    )
    # every numeric flag is finite and in range at parse time (a latency of 0 is a valid link)
    add(
        "--link-latency-us",
        type=bounded_number(low=0, unit="µs"),
        default=None,
        help="custom link: latency per transfer, µs",
    )
    add(
        "--link-gbps",
        type=bounded_number(low=0, low_inclusive=False, unit="Gbit/s"),
        default=None,
        help="custom link: bandwidth, Gbit/s",
    )
    add("--ep-size", type=bounded_number(int, low=2), default=64, help="expert-parallel ranks")
    add(
        "--weight-dtype",
        default="fp8",
        choices=("fp8", "bf16", "fp32"),
        help="linear layers' dtype",
    )


def _add_workload_args(add) -> None:
    """Batch shapes and ubatch counts."""
    add(
        "--decode-tokens",
        type=_int_list,
        default=[16, 32, 64, 128, 256, 512],
        help="decode tokens per device",
    )
    add(
        "--context-len",
        type=bounded_number(int, low=1),
        default=2000,
        help="cached tokens per decode request",
    )
    add(
        "--prefill-tokens",
        type=_int_list,
        default=[1024, 4096, 16384],
        help="prefill tokens per device",
    )
    add(
        "--prompt-len",
        type=bounded_number(int, low=1),
        default=2000,
        help="tokens per prefill request",
    )
    add(
        "--num-ubatches",
        type=_int_list,
        default=None,
        help="N values to compare (>= 2; default 2,3,4, and 2 under --schedule sglang)",
    )
    add(
        "--schedule",
        default="ring",
        choices=("ring", "sglang"),
        help="overlap schedule: ring (this engine's DBO) or sglang (SGLang's two-batch overlap: "
        "its decode strategy, 5 stages per layer, the second batch 2 stages behind; N = 2)",
    )


def _add_calibration_args(add) -> None:
    """Calibration, comparison and outputs."""
    add(
        "--calibrate",
        metavar="TIMELINE_DIR",
        default=None,
        help="fit compute and link to a launch.bench --timeline-dir run",
    )
    add(
        "--calibrate-results",
        default=None,
        help="its launch.bench --output (default TIMELINE_DIR/results.json)",
    )
    add(
        "--compare",
        action="append",
        default=[],
        metavar="RESULTS_JSON",
        help="predicted vs measured for a launch.bench --output file (repeatable: the median "
        "over the files)",
    )
    add(
        "--error-points",
        type=bounded_number(low=0, high=100, unit="points"),
        default=None,
        help="the predictions' error bar in points of speedup (default 10, or the largest "
        "--compare difference if larger): shapes predicted within it of 1.0x stay below the "
        "recommended thresholds (DBO off; the adaptive policy decides)",
    )
    add("--png", default=None, help="draw predicted speedup against tokens per device")
    add("--write-prior", default=None, help="write the adaptive policy's prior (JSON)")


def check_args(ns) -> None:
    """Refuse bad combinations before any work (one line, via ``parser.error``)."""
    if (ns.link_latency_us is None) != (ns.link_gbps is None):
        raise ValueError("--link-latency-us and --link-gbps go together")
    if ns.num_ubatches is None:
        ns.num_ubatches = [2] if ns.schedule == "sglang" else [2, 3, 4]
    if min(ns.num_ubatches) < 2:
        raise ValueError(f"--num-ubatches values must be >= 2, got {ns.num_ubatches}")
    if ns.schedule == "sglang" and ns.num_ubatches != [2]:
        raise ValueError(
            f"--schedule sglang models SGLang's two-batch overlap: --num-ubatches must be 2, "
            f"got {ns.num_ubatches}"
        )
    if ns.schedule == "sglang" and ns.calibrate:
        raise ValueError(
            "--schedule sglang needs a preset model (its stages are priced from the model's "
            "shapes); a calibration fits this engine's ring schedule"
        )


def resolve(ns):
    """(cost model, link, description lines) for the command line.

    Raises:
        ValueError: a bad preset name, config, device, link or timeline.
    """
    from dbo.planning.links import deepep_link, from_gbps

    custom = None
    if ns.link_gbps is not None:
        custom = from_gbps(ns.link_latency_us, ns.link_gbps, name="custom")
    if ns.calibrate:
        from dbo.planning.calibrated_model import calibrate

        model = calibrate(ns.calibrate, ns.calibrate_results)
        link = model.adapt_link(custom) if custom else model.link
        return (
            model,
            link,
            [f"cost model: {model.describe()}", _link_line(model.link, "fitted link")],
        )
    from dbo.planning.devices import resolve_device
    from dbo.planning.roofline_model import RooflineCostModel, Workload
    from moe.model_loader.presets import PRESETS, load_model

    name, config = load_model(ns.model)
    device = resolve_device(ns.device, ns.weight_dtype)
    model = RooflineCostModel(
        config,
        device,
        ep_size=ns.ep_size,
        weight_dtype=ns.weight_dtype,
        workload=Workload(context_len=ns.context_len, prompt_len=ns.prompt_len),
    )
    link = custom or deepep_link(ns.link, ns.ep_size)
    preset = PRESETS.get(name.lower())
    lines = [
        f"model: {name}" + (f" ({preset.source})" if preset else ""),
        f"device: {device.name}; " + "; ".join(f"{k}: {v}" for k, v in device.sources.items()),
        f"cost model: {model.describe()}",
    ]
    return model, link, lines


SCHEDULE_LINES = {
    "ring": "overlap model: N ubatches take turns on the compute in a ring; each transfer hides "
    "behind the other N-1 ubatches' compute; transfers share the link, latencies overlap; DBO off "
    "= N 1",
    "sglang": "overlap model: SGLang's two-batch overlap; decode: 5 stages per layer, the second "
    "batch 2 stages behind, a transfer hides behind the one stage of the other batch between its "
    "issue and receive; prefill: the ring with N 2; transfers share the link; DBO off = N 1",
}


def _link_line(link, what: str = "link") -> str:
    return (
        f"{what}: {link.name}: latency {link.latency_us:.1f} µs, dispatch "
        f"{link.dispatch_gbytes * 8:.3g} / combine {link.combine_gbytes * 8:.3g} Gbit/s, "
        f"SM fraction {link.sm_fraction:.2f} ({link.source})"
    )


def run(ns, model, link, lines: list[str]) -> None:
    """Print the predictions, crossovers, thresholds, sensitivity; write the optional files."""
    from dbo.planning import planner, report

    ns_list = ns.num_ubatches
    compared = report.compare(model, link, ns.compare) if ns.compare else []
    error = error_bar(ns, compared)
    print(*lines, _link_line(link), sep="\n")
    print(SCHEDULE_LINES[ns.schedule])
    shapes = [("decode", t) for t in ns.decode_tokens] + [("prefill", t) for t in ns.prefill_tokens]
    preds = [planner.predict(model, link, k, t, ns_list, schedule=ns.schedule) for k, t in shapes]
    print(report.format_table(preds, ns_list, error))
    caution = report.caution_note(preds, error)
    if caution:
        print(caution)
    flagged = [
        (f"{k}:{t}", found)
        for k, t in shapes
        if (found := report.drift_unmeasured(model, link, k, t)) is not None
    ]
    note = report.drift_note(flagged)
    if note:
        print(note)
    largest: dict[str, int] = {}  # the largest requested shape per kind
    for kind, t in shapes:
        largest[kind] = max(t, largest.get(kind, 0))
    for kind, t in largest.items():
        parts = model.parts_ms(kind, t)
        print(f"C of {kind}:{t} per layer: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    _print_recommendation(ns, model, link, error)
    kind, tokens = (
        ("decode", max(ns.decode_tokens))
        if ns.decode_tokens
        else ("prefill", max(ns.prefill_tokens))
    )
    sens = report.sensitivity(model, link, kind, tokens, 2, schedule=ns.schedule)
    print(report.format_sensitivity(kind, tokens, 2, sens))
    if ns.compare:
        print(f"predicted vs measured (N=2; median over {len(ns.compare)} run(s)):")
        print(report.format_compare(compared))
    _write_files(ns, model, link, ns_list, error)


def error_bar(ns, compared: list[dict]) -> float:
    """The predictions' error bar in speedup: ``--error-points`` / 100 where given; otherwise
    ``planner.DEFAULT_ERROR``, or the largest difference ``--compare`` measured if larger."""
    from dbo.planning import planner, report

    if ns.error_points is not None:
        return ns.error_points / 100
    return report.measured_error(compared, floor=planner.DEFAULT_ERROR)


def _print_recommendation(ns, model, link, error: float) -> None:
    """The crossover per kind and the thresholds (and N) to pass to the engine: a threshold sits
    where the predicted gain clears the error bar ``error`` (in speedup)."""
    from dbo.planning import planner

    highs = {}
    if ns.decode_tokens:
        highs["decode"] = max(ns.decode_tokens)
    if ns.prefill_tokens:
        highs["prefill"] = max(ns.prefill_tokens)
    rec = planner.recommend(model, link, ns.num_ubatches, highs, schedule=ns.schedule, error=error)
    flags = []
    for kind, r in rec.items():
        found, threshold = r["crossover"], r["threshold"]
        if found:
            where = f">= {found} tokens per device, best N at {highs[kind]}: {r['num_ubatches']}"
        else:
            where = f"never up to {highs[kind]} tokens per device"
        print(f"crossover {kind}: DBO pays {where}")
        if found and threshold != found:
            span = f"{found} to <{threshold}" if threshold else f">= {found} (up to {highs[kind]})"
            print(
                f"caution {kind}: at {span} tokens per device the predicted gain is within the "
                f"error (±{100 * error:.0f} points) of 1.0x: the recommended threshold leaves DBO "
                "off there (auto: the adaptive policy decides)"
            )
        flags.append(f"--dbo-{kind}-token-threshold {threshold or 'never'}")
    if ns.schedule != "ring":
        print("(SGLang's schedule: this engine's thresholds come from --schedule ring)")
        return
    print("recommended: " + " ".join(flags) + " ('never': keep DBO off for that kind)")


def _write_files(ns, model, link, ns_list, error: float) -> None:
    from dbo.planning import planner, report

    if ns.write_prior:
        with open(ns.write_prior, "w", encoding="utf-8") as f:
            json.dump(report.prior_table(model, link, error=error), f, indent=1)
        print(f"{PROG}: wrote {ns.write_prior}")
    if ns.png:
        tokens = planner.token_sweep(2, 16384)
        curves = {}
        for kind in ("decode", "prefill"):
            for n in ns_list:
                curves[f"{kind}, N={n}"] = [
                    (t, planner.predict(model, link, kind, t, [n]).speedup[n])
                    for t in tokens
                    if t >= n
                ]
        report.draw_png(ns.png, curves, f"{PROG}: {link.name}")
        print(f"{PROG}: wrote {ns.png}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        check_args(ns)
        model, link, lines = resolve(ns)
    except ValueError as e:
        parser.error(str(e))
    try:
        run(ns, model, link, lines)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
