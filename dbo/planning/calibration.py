"""Fit the planner's compute and link terms to a ``launch.bench --timeline-dir`` run.

Inputs: ``DIR/rank<r>.json`` (each rank's spans) and ``DIR/results.json`` (``launch.bench
--output``: which token counts were decode and which prefill). From every engine step:
- per MoE-layer part (``layer{i}.attention``, ``.router``, ``.dispatch_prep``, ``.dispatch_finish``,
  ``.experts``, ``.combine_prep``, ``.shared_experts``, ``.combine_finish``) its mean ms per layer
  and ubatch, against the ubatch's tokens;
- every ``dispatch`` / ``combine`` of a DBO-off step: its bytes and ms (alone on the link);
- the compute between a segment's part spans that no part span covers (``between_parts``: norms,
  residual adds, the Python between them), per layer and ubatch;
- each transfer's ``payload_ms`` behind an emulated link (``PeerArrival``);
- each turn's overhead: from the later of the previous segment's end and the landing of the
  transfer the resuming ubatch waited for, to its first part (the baton pass, the receive-side
  work, the thread waking up); with DBO off, from each transfer's landing to the next part;
- the step's time outside the layers (scheduling, DP vote, embedding, LM head, sampling, and with
  DBO on the ubatch threads' start and join).
Fits (least squares): each part ``a + b * tokens`` on the DBO-off steps (attention and the outside
time with a slope per kind; ``a`` is what every call costs, so a split pays it per ubatch), and per
part the median ratio of its DBO-step times to that fit at the ubatch's tokens (on a CPU the ubatch
threads and the transfers in flight compete for the cores); the turn overhead per ubatch token
count, DBO-off and DBO steps apart (a curve through the median of the steps' means); the link
``latency + bytes / bandwidth``; the bytes per token; a fixed extra per DBO step outside the layers;
the transfers' ``payload_ms`` kept as samples per step token count.

Steps are told apart by their token count, so a run must not hold two shapes of one count: a
``decode:T`` shape first prefills its T prompts of 8 tokens in steps of up to
``--max-num-batched-tokens`` tokens, which must not equal a ``prefill:`` shape's count (e.g. pass
``--max-num-batched-tokens 4096`` with ``decode:256,prefill:1024``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dbo.timeline.metrics import Span, spans_from_chrome_trace
from dbo.timeline.recorder import CAT_COMM, CAT_COMPUTE, CAT_STEP

PARTS = (
    "attention",
    "router",
    "dispatch_prep",
    "dispatch_finish",
    "experts",
    "combine_prep",
    "shared_experts",
    "combine_finish",
)
BETWEEN_PARTS = "between_parts"  # fitted like a part: the compute no part span covers
PER_KIND = ("attention",)  # parts whose cost per token differs between decode and prefill
_LAYER_SPAN = re.compile(r"^layer(\d+)\.(\w+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Affine:
    """``intercept + slope[kind] * tokens`` in ms (a missing kind uses the other kind's slope)."""

    intercept: float
    slope: dict[str, float]

    def __call__(self, kind: str, num_tokens: float) -> float:
        slope = self.slope.get(kind, statistics.fmean(self.slope.values()) if self.slope else 0.0)
        return max(self.intercept + slope * num_tokens, 0.0)


@dataclass(slots=True)
class TimelineSamples:
    """What calibration reads from a timeline (ms, bytes, tokens per ubatch)."""

    # part -> (kind, tokens per ubatch, number of ubatches, ms per layer and ubatch)
    parts: dict[str, list[tuple[str, float, int, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    transfers: list[tuple[float, float]] = field(default_factory=list)  # (bytes, ms), DBO off
    bytes_per_op: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )  # op -> (tokens, bytes)
    outside: list[tuple[str, float, int, float]] = field(default_factory=list)  # kind, T, N, ms
    # (ubatched, tokens per ubatch, mean ms of the step's turns)
    turns: list[tuple[bool, float, float]] = field(default_factory=list)
    # (ubatched, step tokens) -> each transfer's payload_ms (behind an emulated link)
    payload_ms: dict[tuple[bool, int], list[float]] = field(
        default_factory=lambda: defaultdict(list)
    )
    num_layers: int = 0


def read_records(results_path: Path | str, *, option: str = "--calibrate") -> list[dict]:
    """The records of a ``launch.bench --output`` file (each with its token count, kind and
    speedup); ``option`` names the flag that gave the file, for the error.

    Raises:
        ValueError: an unreadable file or one that is not launch.bench records.
    """
    try:
        records = json.loads(Path(results_path).read_text(encoding="utf-8"))
        for r in records:
            int(r["num_tokens_per_rank"]), str(r["batch_kind"]), r["speedup"]  # noqa: B018
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{option} {results_path}: not launch.bench records ({e})") from None
    return records


def read_kinds(records: list[dict]) -> dict[int, str]:
    """Tokens per rank -> batch kind of ``read_records``' records.

    Raises:
        ValueError: one token count benchmarked as both kinds.
    """
    kinds: dict[int, str] = {}
    for r in records:
        tokens, kind = int(r["num_tokens_per_rank"]), str(r["batch_kind"])
        if kinds.setdefault(tokens, kind) != kind:
            raise ValueError(
                f"--calibrate: {tokens} tokens benchmarked as both decode and prefill (steps are "
                "told apart by their token count: calibrate on a run without such a pair)"
            )
    return kinds


def read_rank_spans(timeline_dir: Path) -> list[list[Span]]:
    """Each ``rank<r>.json`` of ``timeline_dir`` as a list of spans.

    Raises:
        ValueError: no rank file, or one that is not a Chrome trace.
    """
    files = sorted(timeline_dir.glob("rank*.json"))
    if not files:
        raise ValueError(
            f"--calibrate {timeline_dir}: no rank<r>.json (run launch.bench --timeline-dir)"
        )
    out = []
    for path in files:
        try:
            trace = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--calibrate: cannot read {path} ({e})") from None
        out.append(spans_from_chrome_trace(trace, rank=0))
    return out


def collect(spans: list[Span], kinds: dict[int, str], samples: TimelineSamples) -> None:
    """Add one rank's steps to ``samples`` (steps whose token count is not in ``kinds`` are
    skipped: drain steps at other sizes)."""
    spans = sorted(spans, key=lambda s: s.start_ns)
    steps = [s for s in spans if s.cat == CAT_STEP]
    i = 0
    for step in steps:
        while i < len(spans) and spans[i].start_ns < step.start_ns:
            i += 1
        j = i
        while j < len(spans) and spans[j].start_ns < step.end_ns:
            j += 1
        kind = kinds.get(int(step.args.get("num_tokens", 0)))
        if kind is not None:
            _collect_step(step, spans[i:j], kind, samples)


def _collect_step(step: Span, spans: list[Span], kind: str, samples: TimelineSamples) -> None:
    tracks = {s.track.split(" ")[0] for s in spans if s.track.startswith("ubatch")}
    num_ubatches = max(len(tracks), 1)
    tokens = int(step.args.get("num_tokens_padded") or step.args["num_tokens"]) / num_ubatches
    per_part: dict[str, list[float]] = defaultdict(list)
    layer_start, layer_end, layers = math.inf, -math.inf, set()
    layer_spans = []
    for s in spans:
        match = _LAYER_SPAN.match(s.name)
        if match is None:
            continue
        layer, part = int(match.group(1)), match.group(2)
        layers.add(layer)
        layer_start, layer_end = min(layer_start, s.start_ns), max(layer_end, s.end_ns)
        ms = (s.end_ns - s.start_ns) / 1e6
        if s.cat == CAT_COMPUTE and part in PARTS:
            per_part[part].append(ms)
            layer_spans.append(s)
        elif s.cat == CAT_COMM and part in ("dispatch", "combine"):
            num_bytes = float(s.args.get("num_bytes", 0))
            samples.bytes_per_op[part].append((tokens, num_bytes))
            layer_spans.append(s)
            if "payload_ms" in s.args:
                key = (num_ubatches > 1, int(step.args["num_tokens"]))
                samples.payload_ms[key].append(float(s.args["payload_ms"]))
            if num_ubatches == 1:
                samples.transfers.append((num_bytes, ms))
    if not layers:
        return
    num_layers = len(layers)
    samples.num_layers = max(samples.num_layers, num_layers)
    between_ms, turns_ms = _between_parts_and_turns(layer_spans, ubatched=num_ubatches > 1)
    per_part[BETWEEN_PARTS].append(between_ms)
    for part, values in per_part.items():
        # the mean per layer and ubatch: sum over the step / (layers * ubatches)
        mean_ms = sum(values) / (num_layers * num_ubatches)
        samples.parts[part].append((kind, tokens, num_ubatches, mean_ms))
    if turns_ms:
        samples.turns.append((num_ubatches > 1, tokens, statistics.fmean(turns_ms)))
    step_ms = (step.end_ns - step.start_ns) / 1e6
    samples.outside.append(
        (kind, tokens * num_ubatches, num_ubatches, step_ms - (layer_end - layer_start) / 1e6)
    )


def _between_parts_and_turns(spans: list[Span], *, ubatched: bool) -> tuple[float, list[float]]:
    """From one step's part and transfer spans (by start time): the ms between consecutive parts
    of one segment (summed), and each turn's overhead in ms. A turn: with DBO, the ubatch
    computing changes; with DBO off, a transfer ran since the previous part. Its overhead runs
    from the later of the previous part's end and the landing of the resuming ubatch's last
    transfer (while it waited for it) to the resuming part's start."""
    between_ns, turns = 0, []
    prev_track, prev_end_ns = None, 0
    last_transfer: dict[str, Span] = {}
    waited: set[str] = set()  # DBO off: a transfer ran since the track's last part
    for s in spans:
        track = s.track.split(" ")[0]
        if s.cat == CAT_COMM:
            last_transfer[track] = s
            waited.add(track)
            continue
        if prev_track is not None:
            if (ubatched and track != prev_track) or (not ubatched and track in waited):
                transfer = last_transfer.get(track)  # what the resuming ubatch waited for
                landed_ns = transfer.end_ns if transfer is not None else prev_end_ns
                turns.append((s.start_ns - max(prev_end_ns, landed_ns)) / 1e6)
            else:
                between_ns += max(s.start_ns - prev_end_ns, 0)
        waited.discard(track)
        prev_track, prev_end_ns = track, s.end_ns
    return between_ns / 1e6, turns


def fit_affine(points: list[tuple[str, float, float]], *, per_kind: bool) -> Affine:
    """Least squares ``a + b[kind] * x`` over ``(kind, x, y)`` points (a, b clamped to >= 0;
    with one distinct x the intercept is 0: the cost is taken as proportional)."""
    import numpy as np

    if not points:
        return Affine(intercept=0.0, slope={})
    kinds = sorted({k for k, _, _ in points}) if per_kind else ["*"]
    xs = {x for _, x, _ in points}
    rows = []
    for kind, x, _ in points:
        row = [1.0] if len(xs) > 1 else []
        row += [x if (kind == k or not per_kind) else 0.0 for k in kinds]
        rows.append(row)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array([y for _, _, y in points]), rcond=None)
    coef = [max(float(c), 0.0) for c in coef]
    intercept = coef[0] if len(xs) > 1 else 0.0
    slopes = coef[1:] if len(xs) > 1 else coef
    if per_kind:
        return Affine(intercept=intercept, slope=dict(zip(kinds, slopes, strict=True)))
    return Affine(intercept=intercept, slope={"decode": slopes[0], "prefill": slopes[0]})


@dataclass(frozen=True, slots=True, kw_only=True)
class Curve:
    """A measured cost curve in ms: through the median of the samples at each measured token
    count (linear in between), and beyond the measured counts the ``Affine`` fit's shape scaled to
    meet the nearest measured point (a fixed cost per call stays fixed, the rest scales).
    ``points``: kind ("*" for any kind) -> sorted ``(tokens, ms)``."""

    points: dict[str, tuple[tuple[float, float], ...]]
    fallback: Affine

    def __call__(self, kind: str, num_tokens: float) -> float:
        pts = self.points.get(kind) or self.points.get("*") or ()
        if not pts:
            return self.fallback(kind, num_tokens)
        if num_tokens <= pts[0][0] or num_tokens >= pts[-1][0]:
            x0, y0 = pts[0] if num_tokens <= pts[0][0] else pts[-1]
            base = self.fallback(kind, x0)
            return y0 * self.fallback(kind, num_tokens) / base if base > 0 else y0
        i = next(i for i, (x, _) in enumerate(pts) if x >= num_tokens)
        (xa, ya), (xb, yb) = pts[i - 1], pts[i]
        return ya + (yb - ya) * (num_tokens - xa) / (xb - xa)


def fit_curve(points: list[tuple[str, float, float]], *, per_kind: bool) -> Curve:
    """``Curve`` through ``(kind, tokens, ms)`` samples (pooled over kinds unless ``per_kind``)."""
    grouped: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for kind, x, y in points:
        grouped[kind if per_kind else "*"][x].append(y)
    curves = {
        key: tuple(sorted((x, statistics.median(ys)) for x, ys in by_x.items()))
        for key, by_x in grouped.items()
    }
    return Curve(points=curves, fallback=fit_affine(points, per_kind=per_kind))


@dataclass(frozen=True, slots=True)
class PeerArrival:
    """When a collective's last peer payload is there, in ms after this rank issued it, as
    measured: sorted samples per ``(ubatched, step token count)`` (``from_samples``).

    A collective completes on a rank no earlier than its own link deadline and no earlier than
    its peers' bytes are there: the last rank's issue plus the exchange itself (the
    ``--emulate-link`` deadline runs from the rank's own issue; a real all-to-all also waits for
    every peer's bytes). The second is measured on every transfer, under any link (the handle
    stamps the bytes' arrival before the emulated deadline): how far the ranks drift apart (one
    rank stalls, then catches up) and how long the exchange takes while both compute. Whether it
    costs anything depends on the link: it is hidden while the rank's own transfer is still on
    the wire. So the planner samples these offsets per transfer (``schedule.simulate_layers``)
    rather than adding a mean delay.
    """

    samples: dict[tuple[bool, int], tuple[float, ...]]

    @classmethod
    def from_samples(cls, samples: TimelineSamples) -> PeerArrival | None:
        """The transfers' ``payload_ms`` that ``collect`` read: when the peers' bytes were there
        after the rank issued it (the last peer's issue and the exchange itself, whatever the
        emulated link then added). None: no transfer carried it (a run without
        ``--emulate-link``)."""
        if not samples.payload_ms:
            return None
        return cls(samples={k: tuple(sorted(v)) for k, v in samples.payload_ms.items()})

    def draws(self, ubatched: bool, num_tokens: float, k: int = 256) -> tuple[float, ...]:
        """``k`` offsets (ms) for a step of ``num_tokens`` tokens: the distribution between those
        of the calibrated token counts around it, interpolated quantile by quantile in log
        tokens (each quantile moves from one count's value toward the other's; beyond the
        calibrated range, the nearest count's); () without samples of that kind of step."""
        counts = sorted(t for u, t in self.samples if u == ubatched)
        if not counts:
            return ()
        lower = max((t for t in counts if t <= num_tokens), default=counts[0])
        upper = min((t for t in counts if t >= num_tokens), default=counts[-1])
        weight = 0.0
        if upper != lower:
            weight = math.log(num_tokens / lower) / math.log(upper / lower)
        low = _quantiles(self.samples[(ubatched, lower)], k)
        high = _quantiles(self.samples[(ubatched, upper)], k)
        return tuple(a + weight * (b - a) for a, b in zip(low, high, strict=True))

    def mean_ms(self, ubatched: bool, num_tokens: int) -> float:
        """Mean offset at a calibrated token count (0 without samples)."""
        values = self.samples.get((ubatched, num_tokens), ())
        return statistics.fmean(values) if values else 0.0


def _quantiles(values: tuple[float, ...], k: int) -> tuple[float, ...]:
    """``k`` evenly spaced order statistics of the sorted ``values``."""
    if k <= 0 or not values:
        return ()
    return tuple(values[min(int((i + 0.5) * len(values) / k), len(values) - 1)] for i in range(k))
