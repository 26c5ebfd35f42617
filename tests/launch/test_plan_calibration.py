"""``launch.plan --calibrate``: the fit recovers a synthetic timeline laid out by the schedule, the
transfers' peer arrival (``payload_ms``) and its interpolation, the shapes whose drift the
calibration did not measure, and the calibrate-and-compare command line."""

from __future__ import annotations

import json

import pytest

from dbo.planning.calibrated_model import calibrate
from dbo.planning.calibration import PeerArrival, TimelineSamples, collect, read_rank_spans
from dbo.planning.links import from_gbps
from dbo.planning.planner import step_ms
from dbo.planning.report import drift_note, drift_unmeasured
from launch import plan
from tests.launch.test_plan import sglang_decode_model


def peer_arrival_samples(ranks, kinds):
    """``PeerArrival`` of the ranks' spans, read as calibration reads them."""
    samples = TimelineSamples()
    for spans in ranks:
        collect(spans, kinds, samples)
    return PeerArrival.from_samples(samples)


def test_peer_arrival_from_payload_ms(tmp_path):
    # one decode step of 64 tokens per rank, one dispatch each: rank 0's peer bytes were there
    # 1.6 ms after its issue (rank 1 issued late), rank 1's 0.1 ms after its own
    for rank, payload_ms in ((0, 1.6), (1, 0.1)):
        events = [
            _trace_event("step", "step", 0, 0.0, 3.0, {"num_tokens": 64, "step": 0}),
            _trace_event(
                "layer0.dispatch",
                "comm",
                101,
                1.0,
                1.6,
                {"num_bytes": 64e3, "payload_ms": payload_ms},
            ),
        ]
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    spans = read_rank_spans(tmp_path)
    arrival = peer_arrival_samples(spans, {64: "decode"})
    assert arrival.samples[(False, 64)] == pytest.approx((0.1, 1.6))
    assert arrival.mean_ms(False, 64) == pytest.approx(0.85)
    # a token count that was not benchmarked is skipped; no payload_ms (no emulated link): None
    assert peer_arrival_samples(spans, {32: "decode"}) is None
    for span in spans[0]:
        span.args.pop("payload_ms", None)
    assert peer_arrival_samples(spans[:1], {64: "decode"}) is None


def test_peer_arrival_draws_interpolate_the_neighbouring_counts():
    arrival = PeerArrival(samples={(True, 32): (1.0, 2.0), (True, 128): (3.0, 8.0)})
    assert arrival.draws(True, 32, k=2) == (1.0, 2.0)
    assert arrival.draws(True, 16, k=2) == (1.0, 2.0)  # below the range: the nearest count
    assert arrival.draws(True, 512, k=2) == (3.0, 8.0)
    # halfway in log2: each quantile halfway (not half of the draws from each count)
    assert arrival.draws(True, 64, k=2) == pytest.approx((2.0, 5.0))
    assert arrival.draws(True, 64, k=4) == pytest.approx((2.0, 2.0, 5.0, 5.0))
    assert arrival.draws(False, 64) == ()  # no DBO-off samples


def _trace_event(name, cat, tid, start_ms, dur_ms, args=None) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": 0,
        "tid": tid,
        "ts": start_ms * 1e3,
        "dur": dur_ms * 1e3,
        "args": args or {},
    }


# (ms, ms per token) of the parts; pre = attention, router; mid = experts; post = combine_finish
TRUTH = {
    "attention": (0.05, 0.002),
    "router": (0.01, 0.0001),
    "experts": (0.1, 0.004),
    "combine_finish": (0.02, 0.0001),
}


BYTES_PER_TOKEN, OUTSIDE_MS, NUM_LAYERS = 1000.0, 2.0, 2


TRUTH_LINK = from_gbps(100.0, 0.512)  # 64 tokens: 64 kB = 1 ms on the wire


BETWEEN_MS = 0.01  # between the attention and the router (once per layer and ubatch)


TURN_MS = {False: 0.02, True: 0.05}  # DBO off: after a transfer lands; DBO: a ubatch's turn


def _synthetic_step(events, step, t0, tokens, num_ubatches, slowdown) -> float:
    """Append one step's spans, laid out by the ring schedule (``simulate_layers``) on
    ``TRUTH_LINK`` with ``TURN_MS`` and ``BETWEEN_MS`` (parts of a DBO step ``slowdown`` times
    slower); return its end in ms."""
    per, dbo = tokens / num_ubatches, num_ubatches > 1
    factor = slowdown if dbo else 1.0
    tids = [10 + u if dbo else 1 for u in range(num_ubatches)]
    state = {"now": t0 + OUTSIDE_MS / 2, "link_free": 0.0}
    ready = [0.0] * num_ubatches

    def parts(layer, u, names):
        for part in names:
            a, b = TRUTH[part]
            ms = (a + b * per) * factor
            state["now"] += BETWEEN_MS if part == "router" else 0.0
            events.append(
                _trace_event(f"layer{layer}.{part}", "compute", tids[u], state["now"], ms)
            )
            state["now"] += ms

    def send(layer, u, op) -> float:
        num_bytes = BYTES_PER_TOKEN * per
        start = max(state["now"], state["link_free"])
        state["link_free"] = start + TRUTH_LINK.wire_ms(op, num_bytes)
        landed = state["link_free"] + TRUTH_LINK.latency_ms(op)
        args = {"num_bytes": num_bytes, "payload_ms": 0.0}  # ranks in lockstep: bytes there at once
        ms = landed - state["now"]
        events.append(
            _trace_event(f"layer{layer}.{op}", "comm", tids[u] + 100, state["now"], ms, args)
        )
        return landed

    def take_turn(u, charged=True):
        state["now"] = max(state["now"], ready[u]) + (TURN_MS[dbo] if charged else 0.0)

    for layer in range(NUM_LAYERS):
        for u in range(num_ubatches):
            take_turn(u, dbo and bool(layer or u))
            parts(layer, u, (["combine_finish"] if layer else []) + ["attention", "router"])
            ready[u] = send(layer, u, "dispatch")
        for u in range(num_ubatches):
            take_turn(u)
            parts(layer, u, ["experts"])
            ready[u] = send(layer, u, "combine")
            if not dbo:
                state["now"] = ready[u] + TURN_MS[False]
    for u in range(num_ubatches):
        take_turn(u, dbo)
        parts(NUM_LAYERS - 1, u, ["combine_finish"])
    end = state["now"] + OUTSIDE_MS / 2 + (0.5 if dbo else 0.0)
    args = {"num_tokens": tokens, "is_ubatched": dbo, "step": step}
    events.append(_trace_event("step", "step", 0, t0, end - t0, args))
    return end


def write_synthetic_timeline(directory, slowdown: float = 1.0, num_ranks: int = 1) -> None:
    """A ``launch.bench`` run in miniature: decode:64 and decode:256, off and on, on
    ``num_ranks`` ranks that run in lockstep."""
    names = {
        0: "engine step",
        1: "main compute",
        101: "main comm",
        10: "ubatch0 compute",
        11: "ubatch1 compute",
        110: "ubatch0 comm",
        111: "ubatch1 comm",
    }
    events = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
        for tid, name in names.items()
    ]
    now, step = 0.0, 0
    for tokens in (64, 256):
        for num_ubatches in (1, 2, 1, 2):
            now = _synthetic_step(events, step, now, tokens, num_ubatches, slowdown) + 1.0
            step += 1
    for rank in range(num_ranks):
        (directory / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    records = [
        {
            "num_tokens_per_rank": t,
            "batch_kind": "decode",
            "batch": f"decode:{t}",
            "speedup": 1.0,
            "emulate_link": "latency_us=100,gbps=0.512",
        }
        for t in (64, 256)
    ]
    (directory / "results.json").write_text(json.dumps(records))


def test_calibration_recovers_a_synthetic_timeline(tmp_path):
    write_synthetic_timeline(tmp_path, slowdown=1.1)
    model = calibrate(tmp_path)
    assert model.ubatched_factor["experts"] == pytest.approx(1.1)
    assert model.num_moe_layers == NUM_LAYERS
    assert model.link.latency_us == pytest.approx(100, rel=1e-3)
    assert model.link.dispatch_gbytes * 8 == pytest.approx(0.512, rel=1e-3)
    assert model.bytes_per_token["dispatch"] == pytest.approx(BYTES_PER_TOKEN)
    # the run's --emulate-link is what was fitted: nothing to carry over to other links
    assert model.link_overhead_us == pytest.approx(0, abs=0.1)
    # the bytes were there at issue: the link alone decides
    assert set(model.peer_arrival_ms(64, 2)) == {0.0} and model.peer_arrival.mean_ms(True, 64) == 0
    assert model.bandwidth_ratio == pytest.approx(1, rel=1e-3)
    other = model.adapt_link(from_gbps(200, 0.14))
    assert other.latency_us == pytest.approx(
        200, abs=0.1
    ) and other.dispatch_gbytes * 8 == pytest.approx(0.14, rel=1e-3)
    for part, (a, b) in TRUTH.items():
        fallback = model.parts[part].fallback
        assert fallback.intercept == pytest.approx(a, rel=1e-3)
        assert fallback.slope["decode"] == pytest.approx(b, rel=1e-3)
        for tokens in (16, 64, 100, 256, 1024):  # on the measured points, between, beyond
            assert model.parts[part]("decode", tokens) == pytest.approx(a + b * tokens, rel=1e-3)
    assert model.outside("decode", 64) == pytest.approx(OUTSIDE_MS, rel=1e-3)
    assert model.dbo_step_ms == pytest.approx(0.5, rel=1e-3)
    for ubatched, turn in TURN_MS.items():
        assert model.turn_ms(32, 1 + ubatched) == pytest.approx(turn, rel=1e-3)
    assert model.parts["between_parts"]("decode", 64) == pytest.approx(BETWEEN_MS)
    # both arms are predicted exactly: the timeline was laid out by the schedule
    for tokens, num_ubatches, step in ((64, 1, 0), (64, 2, 1), (256, 1, 4), (256, 2, 5)):
        events = []
        measured = _synthetic_step(events, step, 0.0, tokens, num_ubatches, 1.1)
        predicted = step_ms(model, model.link, "decode", tokens, num_ubatches)
        assert predicted == pytest.approx(measured, rel=1e-6)


def test_drift_unmeasured_flags_shapes_the_calibration_ran_link_bound(tmp_path):
    write_synthetic_timeline(tmp_path, slowdown=1.1)
    model = calibrate(tmp_path)
    # on the calibration run's own link decode:64 is link-bound: 1 ms on the wire per ubatch
    # transfer against ~0.4 ms of compute per ubatch and layer
    assert model.comm_to_compute("decode", 64) > 1.4
    near = from_gbps(10.0, 1.2)  # a faster link runs it near balance
    assert 0.8 <= model.comm_to_compute("decode", 64, near) <= 1.4
    flagged = drift_unmeasured(model, near, "decode", 64)
    assert flagged == pytest.approx(
        (model.comm_to_compute("decode", 64), model.comm_to_compute("decode", 64, near))
    )
    note = drift_note([("decode:64", flagged)])
    assert note.startswith("drift not measured near balance: decode:64 (") and "too high" in note
    # the calibration's own link, a link still link-bound, a compute-bound one: nothing to flag
    for link in (model.link, from_gbps(50.0, 0.8), from_gbps(1.0, 100.0)):
        assert drift_unmeasured(model, link, "decode", 64) is None
    assert drift_note([]) is None
    roofline, link = sglang_decode_model()  # presets: no calibration run to speak of
    assert drift_unmeasured(roofline, link, "decode", 64) is None


def test_calibration_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        calibrate(tmp_path / "missing")
    with pytest.raises(ValueError, match="results.json not found"):
        calibrate(tmp_path)
    (tmp_path / "results.json").write_text("[]")
    with pytest.raises(ValueError, match="no rank<r>.json"):
        calibrate(tmp_path)


def test_cli_calibrate_and_compare(capsys, tmp_path):
    write_synthetic_timeline(tmp_path, num_ranks=2)
    results = str(tmp_path / "results.json")
    assert plan.main(["--calibrate", str(tmp_path), "--compare", results]) == 0
    out = capsys.readouterr().out
    # two ranks in lockstep: every peer's payload is there when the own one lands
    assert (
        f"cost model: calibrated on {tmp_path}; a turn's overhead (ubatch tokens: ms) DBO off "
        "64: 0.020, 256: 0.020; DBO 32: 0.050, 128: 0.050; in DBO steps the last peer's payload "
        "is there, on average, this long after a rank's issue (step tokens: ms) 64: 0.00, 256: "
        "0.00"
    ) in out
    assert "fitted link:" in out and "| latency_us=100,gbps=0.512 | decode:64 |" in out


def test_curve_interpolates_and_scales_beyond():
    from dbo.planning.calibration import fit_curve

    # experts-like: 1 ms at 64 tokens, 5 ms at 256, 20 ms at 1024 (not affine)
    curve = fit_curve(
        [("decode", 64, 1.0), ("decode", 256, 5.0), ("prefill", 1024, 20.0)], per_kind=False
    )
    assert curve("decode", 64) == pytest.approx(1.0) and curve("prefill", 1024) == pytest.approx(
        20.0
    )
    assert curve("decode", 160) == pytest.approx(3.0)  # halfway between 64 and 256
    below = curve("decode", 32)
    assert 0 < below < 1.0
    a, b = curve.fallback.intercept, curve.fallback.slope["decode"]
    assert below == pytest.approx((a + 32 * b) / (a + 64 * b))
