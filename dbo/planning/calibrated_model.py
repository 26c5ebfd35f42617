"""``CalibratedCostModel``: the planner's cost model with every term fitted to one timeline run
(``dbo.planning.calibration`` reads the samples)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from dbo.planning.calibration import (
    BETWEEN_PARTS,
    PARTS,
    PER_KIND,
    Curve,
    PeerArrival,
    TimelineSamples,
    collect,
    fit_curve,
    read_kinds,
    read_rank_spans,
    read_records,
)
from dbo.planning.links import LinkModel, from_gbps
from dbo.planning.schedule import LayerCosts, serial_layer_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibratedCostModel:
    """Fitted terms (ms per layer and ubatch as functions of its tokens; see ``calibration``).

    ``parts``: part name -> ``Curve``; ``bytes_per_token``: op -> bytes per token on the wire;
    ``outside``: per-step ms outside the MoE layers with DBO off; ``dbo_step_ms``: what a DBO step
    adds outside the layers (thread start and join); ``turn``: ubatched -> ms from a transfer's
    landing (or the previous ubatch's yield) to the resuming part, per ubatch token count;
    ``link``: the fitted link; ``num_moe_layers``; ``ubatched_factor``: part -> measured / fitted
    time of the part in DBO steps (the ubatch threads and the transfers in flight share the CPU).
    """

    parts: dict[str, Curve]
    bytes_per_token: dict[str, float]
    outside: Curve
    dbo_step_ms: float
    turn: dict[bool, Curve]
    link: LinkModel
    num_moe_layers: int
    source: str = ""
    ubatched_factor: dict[str, float] = field(default_factory=dict)
    # the fitted link against the calibration run's --emulate-link: extra µs per transfer and the
    # ratio of bandwidths, carried over to any other link it predicts (adapt_link)
    link_overhead_us: float = 0.0
    bandwidth_ratio: float = 1.0
    # when a transfer's peer bytes were there after this rank's issue, as measured on the
    # calibration run (DBO-off and DBO steps apart); None: no --emulate-link run
    peer_arrival: PeerArrival | None = None

    def _part(self, name: str, kind: str, num_tokens: float, num_ubatches: int) -> float:
        fit = self.parts.get(name)
        if fit is None:
            return 0.0
        factor = self.ubatched_factor.get(name, 1.0) if num_ubatches > 1 else 1.0
        return fit(kind, num_tokens) * factor

    def parts_ms(self, kind: str, num_tokens: float) -> dict[str, float]:
        """One MoE layer's compute by fitted part (ms) for ``num_tokens`` tokens."""
        return {name: fit(kind, num_tokens) for name, fit in self.parts.items()}

    def layer_costs(self, kind: str, num_tokens: float, *, num_ubatches: int = 1) -> LayerCosts:
        """One ``num_tokens``-token ubatch in one MoE layer of a step cut in ``num_ubatches``."""

        def p(*names):
            return sum(self._part(n, kind, num_tokens, num_ubatches) for n in names)

        return LayerCosts(
            pre_ms=p("attention", "router", "dispatch_prep", BETWEEN_PARTS),
            mid_ms=p("dispatch_finish", "experts", "combine_prep"),
            shared_ms=p("shared_experts"),
            post_ms=p("combine_finish"),
            dispatch_bytes=self.bytes_per_token.get("dispatch", 0.0) * num_tokens,
            combine_bytes=self.bytes_per_token.get("combine", 0.0) * num_tokens,
        )

    def turn_ms(self, num_tokens: float, num_ubatches: int) -> float:
        """One turn's overhead (ms) for ubatches of ``num_tokens`` tokens (``simulate_layers``'s
        ``turn_ms``); 0 where the timeline had no turns of that kind of step."""
        curve = self.turn.get(num_ubatches > 1)
        return curve("*", num_tokens) if curve is not None else 0.0

    def comm_to_compute(self, kind: str, num_tokens: float, link: LinkModel | None = None) -> float:
        """M / C of one ubatch's MoE layer in a two-ubatch step of ``num_tokens`` tokens on
        ``link`` (default: the link fitted to the calibration run): above 1 the transfers take
        longer than the compute that hides them."""
        compute_ms, comm_ms = serial_layer_ms(
            self.layer_costs(kind, num_tokens / 2, num_ubatches=2), link or self.link
        )
        return comm_ms / compute_ms if compute_ms > 0 else math.inf

    def outside_ms(self, kind: str, num_tokens: float, num_ubatches: int) -> float:
        """Per step outside the MoE layers; a DBO step adds ``dbo_step_ms`` per extra ubatch."""
        return self.outside(kind, num_tokens) + self.dbo_step_ms * (num_ubatches - 1)

    def describe(self) -> str:
        """``calibrated on DIR``; the turn overhead per calibrated ubatch token count; and the
        mean peer arrival of DBO steps per calibrated step token count."""
        turns = "; ".join(
            f"{'DBO' if ubatched else 'DBO off'} "
            + ", ".join(f"{t:g}: {ms:.3f}" for t, ms in self.turn[ubatched].points.get("*", ()))
            for ubatched in sorted(self.turn)
        )
        text = f"calibrated on {self.source}; a turn's overhead (ubatch tokens: ms) {turns}"
        if self.peer_arrival is None:
            return (
                f"{text}; no peer arrival measured (a run without --emulate-link, or one whose "
                "transfers carry no payload_ms): the link alone decides when a transfer lands"
            )
        counts = sorted(t for u, t in self.peer_arrival.samples if u)
        means = ", ".join(f"{t}: {self.peer_arrival.mean_ms(True, t):.2f}" for t in counts)
        return (
            f"{text}; in DBO steps the last peer's payload is there, on average, this long "
            f"after a rank's issue (step tokens: ms) {means}"
        )

    def peer_arrival_ms(self, num_tokens: float, num_ubatches: int) -> tuple[float, ...]:
        """Offsets (ms) to draw a transfer's peer arrival from, for a step of ``num_tokens``
        tokens cut into ``num_ubatches`` (N >= 3 uses the two-ubatch samples); () without a
        measurement."""
        if self.peer_arrival is None:
            return ()
        return self.peer_arrival.draws(num_ubatches > 1, num_tokens)

    def adapt_link(self, link: LinkModel) -> LinkModel:
        """``link`` as this machine would run it: plus the per-transfer overhead and times the
        bandwidth ratio measured against the calibration run's emulated link."""
        return replace(
            link.scaled(bandwidth=self.bandwidth_ratio),
            latency_us=link.latency_us + self.link_overhead_us,
            combine_latency_us=None,
            name=link.name,
        )


def _fit_link(samples: TimelineSamples, name: str) -> LinkModel:
    """``latency + bytes / bandwidth`` over the DBO-off transfers (least squares)."""
    import numpy as np

    if len(samples.transfers) < 2:
        raise ValueError("--calibrate: need DBO-off steps with transfers (run the off arm)")
    x = np.array([[1.0, b] for b, _ in samples.transfers])
    y = np.array([ms for _, ms in samples.transfers])
    (alpha_ms, ms_per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
    ms_per_byte = max(float(ms_per_byte), 1e-15)
    gbps = 8 / (ms_per_byte * 1e6)  # bits per ns = Gbit/s
    return from_gbps(max(float(alpha_ms), 0.0) * 1e3, gbps, name=name, source=f"fitted on {name}")


def _bytes_per_token(samples: TimelineSamples) -> dict[str, float]:
    return {
        op: sum(b for _, b in pts) / max(sum(t for t, _ in pts), 1e-9)
        for op, pts in samples.bytes_per_op.items()
    }


def fit(samples: TimelineSamples, *, source: str) -> CalibratedCostModel:
    """Fit every term (see the module docstring of ``calibration``).

    Raises:
        ValueError: no MoE layer spans, or no DBO-off transfers.
    """
    if not samples.num_layers or not samples.parts:
        raise ValueError("--calibrate: no layer spans in the timeline (was it a launch.bench run?)")
    parts, factors = {}, {}
    for part in (*PARTS, BETWEEN_PARTS):
        points = samples.parts.get(part)
        if not points:
            continue
        off = [(k, t) for k, t, n, _ in points if n == 1]
        fitted = fit_curve(
            [(k, t, ms) for k, t, n, ms in points if n == 1 or not off], per_kind=part in PER_KIND
        )
        ratios = [ms / fitted(k, t) for k, t, n, ms in points if n > 1 and fitted(k, t) > 0]
        parts[part] = fitted
        if off and ratios:
            factors[part] = statistics.median(ratios)
    off = [(k, t, ms) for k, t, n, ms in samples.outside if n == 1]
    outside = fit_curve(off, per_kind=True)
    extra = [ms - outside(k, t) for k, t, n, ms in samples.outside if n > 1]
    return CalibratedCostModel(
        parts=parts,
        bytes_per_token=_bytes_per_token(samples),
        outside=outside,
        dbo_step_ms=max(statistics.median(extra), 0.0) if extra else 0.0,
        turn={
            ubatched: fit_curve(
                [("*", t, ms) for u, t, ms in samples.turns if u == ubatched], per_kind=False
            )
            for ubatched in {u for u, _, _ in samples.turns}
        },
        link=_fit_link(samples, source),
        num_moe_layers=samples.num_layers,
        source=source,
        ubatched_factor=factors,
    )


def calibrate(timeline_dir: str | Path, results: str | Path | None = None) -> CalibratedCostModel:
    """Read ``timeline_dir`` (rank files, and ``results.json`` unless ``results`` names the
    ``launch.bench --output`` file) and fit the model.

    Raises:
        ValueError: a missing or unreadable input, or too little data to fit.
    """
    directory = Path(timeline_dir)
    if not directory.is_dir():
        raise ValueError(f"--calibrate {timeline_dir!r}: not a directory")
    results_path = Path(results) if results else directory / "results.json"
    if not results_path.is_file():
        raise ValueError(
            f"--calibrate: {results_path} not found (run launch.bench with --output "
            f"{directory}/results.json, or pass --calibrate-results)"
        )
    records = read_records(results_path)
    kinds = read_kinds(records)
    samples = TimelineSamples()
    for spans in read_rank_spans(directory):
        collect(spans, kinds, samples)
    model = fit(samples, source=str(directory))
    emulated = _emulated_link(records)
    if emulated is None:
        return model
    return replace(
        model,
        link_overhead_us=max(model.link.latency_us - emulated.latency_us, 0.0),
        bandwidth_ratio=model.link.dispatch_gbytes * 8 / emulated.gbps,
        peer_arrival=PeerArrival.from_samples(samples),
    )


def _emulated_link(records: list[dict]):
    """The ``--emulate-link`` of a ``launch.bench`` run's records (``LinkSpec``), or None."""
    from distributed.link_emulation import LinkSpec

    specs = {r.get("emulate_link") for r in records}
    if len(specs) != 1 or None in specs:
        return None
    return LinkSpec.parse(specs.pop())
