"""``launch.plan``: the overlap schedule and roofline on hand-worked cases, the presets' sources,
the SGLang decode reproduction, the adaptive policy's prior, and the CLI's lines and errors
(calibration: ``test_plan_calibration.py``)."""

from __future__ import annotations

import json
import math

import pytest

from dbo import Bucket
from dbo.planning.devices import DEVICE_PRESETS, DeviceSpec
from dbo.planning.links import DEEPEP_LL_GBYTES, LinkModel, deepep_link, from_gbps
from dbo.planning.planner import bucket_prior, crossover, predict, step_ms, token_sweep
from dbo.planning.report import prior_table
from dbo.planning.roofline_model import RooflineCostModel, Workload
from dbo.planning.schedule import LayerCosts, simulate_layers, simulate_sglang_decode
from launch import plan
from moe.model_loader.presets import PRESETS, load_model

# 1 ms on the wire per transfer (1e6 bytes at 1 GB/s), 0.1 ms latency
LINK = LinkModel(name="test", latency_us=100, dispatch_gbytes=1.0, combine_gbytes=1.0)
COSTS = LayerCosts(pre_ms=1, mid_ms=2, shared_ms=0.5, dispatch_bytes=1e6, combine_bytes=1e6)


def test_off_is_serial():
    # pre 1, dispatch 1 + 0.1, mid 2, combine 1 + 0.1, shared 0.5 (after the combine landed)
    assert simulate_layers(COSTS, num_layers=1, num_ubatches=1, link=LINK) == pytest.approx(5.7)
    assert simulate_layers(COSTS, num_layers=3, num_ubatches=1, link=LINK) == pytest.approx(17.1)


def test_two_ubatches_hand_worked():
    # u0 pre [0,1], D0 wire [1,2] lands 2.1; u1 pre [1,2], D1 wire [2,3] lands 3.1;
    # u0 mid [2.1,4.1], K0 wire [4.1,5.1] lands 5.2, shared [4.1,4.6];
    # u1 mid [4.6,6.6], K1 wire [6.6,7.6] lands 7.7, shared [6.6,7.1]; done at 7.7
    assert simulate_layers(COSTS, num_layers=1, num_ubatches=2, link=LINK) == pytest.approx(7.7)
    # a 0.01 ms turn before each of the 5 turns (every segment but the step's first): u1's pre
    # [1.01,2.01], D1 lands 3.11; u0's mid [2.11,4.11]; u1's mid [4.62,6.62], K1 lands 7.72;
    # the last turn (u1's receive of K1) ends at 7.73
    with_turns = simulate_layers(COSTS, num_layers=1, num_ubatches=2, link=LINK, turn_ms=0.01)
    assert with_turns == pytest.approx(7.73)
    # DBO off: a turn after each transfer lands (the receive): D lands 2.1, mid [2.11,4.11], K
    # lands 5.21, shared [5.22,5.72]
    off = simulate_layers(COSTS, num_layers=1, num_ubatches=1, link=LINK, turn_ms=0.01)
    assert off == pytest.approx(5.72)


def test_peer_arrival_hand_worked():
    costs = LayerCosts(pre_ms=1, mid_ms=1, dispatch_bytes=1e6, combine_bytes=1e6)
    # DBO off, one layer: D issued at 1 lands at max(1 + 1.1, 1 + 3) = 4; mid [4, 5]; K lands
    # at max(5 + 1.1, 5 + 3) = 8 (the link alone: D lands at 2.1, mid [2.1, 3.1], K at 4.2)
    assert simulate_layers(costs, num_layers=1, num_ubatches=1, link=LINK) == pytest.approx(4.2)
    late = simulate_layers(costs, num_layers=1, num_ubatches=1, link=LINK, peer_arrival_ms=[3.0])
    assert late == pytest.approx(8.0)
    # peers that are there before the own bytes land change nothing
    early = simulate_layers(costs, num_layers=2, num_ubatches=2, link=LINK, peer_arrival_ms=[0.5])
    assert early == pytest.approx(simulate_layers(costs, num_layers=2, num_ubatches=2, link=LINK))
    # drawn offsets: the mean over the draws lies between the runs with the smallest and the
    # largest offset alone, and is reproducible
    drawn = [
        simulate_layers(costs, num_layers=2, num_ubatches=2, link=LINK, peer_arrival_ms=o)
        for o in ([0.0, 4.0], [0.0, 4.0], [0.0], [4.0])
    ]
    assert drawn[0] == drawn[1] and drawn[2] < drawn[0] < drawn[3]
    with pytest.raises(ValueError, match="num_draws"):
        simulate_layers(costs, num_layers=1, num_ubatches=1, link=LINK, num_draws=0)


def test_compute_bound_and_link_bound_limits():
    fast = LinkModel(name="fast", latency_us=0, dispatch_gbytes=1e9, combine_gbytes=1e9)
    for n in (2, 3, 4):  # no link: the ubatches' compute back to back
        ms = simulate_layers(COSTS, num_layers=2, num_ubatches=n, link=fast)
        assert ms == pytest.approx(2 * n * COSTS.compute_ms, rel=1e-6)
    tiny = LayerCosts(pre_ms=0, mid_ms=0, dispatch_bytes=1e6, combine_bytes=1e6)
    # no compute: the link is busy 2 ms per ubatch and layer, plus the last latency
    assert simulate_layers(tiny, num_layers=2, num_ubatches=3, link=LINK) == pytest.approx(12.1)


def test_sglang_decode_schedule_hand_worked():
    # SGLang's decode stages (prepare 0.4 | core 0.6 | D issue, shared 0.5 | D recv, mid 2, K issue
    # | K recv), batch b two stages behind a: a0 [0,0.4], a1 [0.4,1], a2 D_a wire [1,2] lands 2.1,
    # shared [1,1.5]; b0 [1.5,1.9]; a3 waits 2.1, mid [2.1,4.1], K_a wire [4.1,5.1] lands 5.2;
    # b1 [4.1,4.7]; a4 waits 5.2; b2 D_b wire [5.2,6.2] lands 6.3, shared [5.2,5.7]; b3 waits 6.3,
    # mid [6.3,8.3], K_b lands 9.4; b4 waits 9.4. The ring hides more (7.7): there a transfer
    # hides behind the other ubatch's whole segment, here no transfer is in flight while a
    # batch runs its experts.
    costs = LayerCosts(
        pre_ms=1,
        mid_ms=2,
        shared_ms=0.5,
        dispatch_bytes=1e6,
        combine_bytes=1e6,
        attn_prepare_ms=0.4,
    )
    assert simulate_sglang_decode(costs, num_layers=1, link=LINK) == pytest.approx(9.4)
    assert simulate_layers(costs, num_layers=1, num_ubatches=2, link=LINK) == pytest.approx(7.7)
    # no offset: the two batches' stages alternate from the start
    assert simulate_sglang_decode(costs, num_layers=1, link=LINK, delta_stages=0) < 9.4
    with pytest.raises(ValueError, match="delta_stages >= 0"):
        simulate_sglang_decode(costs, num_layers=1, link=LINK, delta_stages=-1)


def test_layer_costs_validation():
    with pytest.raises(ValueError, match="pre_ms must be >= 0"):
        LayerCosts(pre_ms=-1, mid_ms=0)
    with pytest.raises(ValueError, match="cannot exceed"):
        LayerCosts(pre_ms=1, mid_ms=0, attn_prepare_ms=2)
    with pytest.raises(ValueError, match="num_ubatches >= 1"):
        simulate_layers(COSTS, num_layers=1, num_ubatches=0, link=LINK)


def _unit_device(**kw) -> DeviceSpec:
    # 1 TFLOP/s, 1 TB/s, no kernel floor: times are FLOPs / 1e12 or bytes / 1e12
    base = dict(
        name="unit",
        peak_tflops={"bf16": 1.0},
        mem_tbps=1.0,
        gemm_efficiency=1.0,
        mem_efficiency=1.0,
        kernel_us=0.0,
    )
    return DeviceSpec(**{**base, **kw})


def test_roofline_gemm_hand_worked():
    _, config = load_model("Mixtral-8x7B")
    model = RooflineCostModel(config, _unit_device(), ep_size=8, weight_dtype="bf16")
    # 1 row: weights 1000*1000*2 B + activations 2000*2 B read at 1 TB/s = 2.004 µs (memory-bound)
    assert model.gemm_ms(1, 1000, 1000) == pytest.approx(2.004e-3)
    # 4096 rows: 2*4096*1e6 FLOP at 1 TFLOP/s = 8.192 ms (compute-bound)
    assert model.gemm_ms(4096, 1000, 1000) == pytest.approx(8.192)
    floor = RooflineCostModel(config, _unit_device(kernel_us=5.0), ep_size=8, weight_dtype="bf16")
    assert floor.gemm_ms(1, 1000, 1000) == pytest.approx(2.004e-3 + 5e-3)


def test_splitting_costs_more_on_small_batches():
    # memory-bound experts: half the rows cost nearly the whole batch's weight reads
    _, config = load_model("DeepSeek-V3")
    model = RooflineCostModel(config, DEVICE_PRESETS["h100-sxm"], ep_size=64)
    whole, half = model.experts_ms(32), model.experts_ms(16)
    assert half > 0.8 * whole
    assert model.experts_ms(4096) / model.experts_ms(2048) > 1.8  # compute-bound: ~linear


def test_presets_state_their_sources():
    for preset in PRESETS.values():
        assert preset.source.startswith("huggingface.co/")
        load_model(preset.name)  # parses with the project's config reader
    for device in DEVICE_PRESETS.values():
        assert {"gemm_efficiency", "mem_efficiency", "kernel_us"} <= device.sources.keys()
        assert any("NVIDIA" in v for v in device.sources.values())
    for ep in (8, 72, 256):
        assert "DeepEP" in deepep_link("deepep-ll", ep).source
        assert "DeepEP" in deepep_link("deepep-ht", ep).source


def test_deepep_table_is_bytes_over_latency():
    # DeepEP's LL table: 128 tokens x top-8 x (7168 FP8 + scales) at EP 8: 77 µs at 98 GB/s
    link = deepep_link("deepep-ll", 8)
    dispatch_bytes = 128 * 8 * 7168 * (1 + 4 / 128)
    assert link.wire_ms("dispatch", dispatch_bytes) * 1e3 == pytest.approx(77, rel=0.03)
    assert link.wire_ms("combine", 128 * 8 * 7168 * 2) * 1e3 == pytest.approx(114, rel=0.03)
    assert sorted(DEEPEP_LL_GBYTES) == [8, 16, 32, 64, 128, 256]
    # EP 64: the published latency = wire time at the NIC's 50 GB/s (63/64 of the bytes) + alpha
    link = deepep_link("deepep-ll", 64)
    assert link.transfer_ms("dispatch", dispatch_bytes) * 1e3 == pytest.approx(173)
    assert link.transfer_ms("combine", 128 * 8 * 7168 * 2) * 1e3 == pytest.approx(314)


def sglang_decode_model():
    """The lmsys blog's decode deployment: DeepSeek-V3, H100, EP 72 (9 nodes), 2000-token
    context, DeepEP low latency."""
    _, config = load_model("DeepSeek-V3")
    model = RooflineCostModel(
        config, DEVICE_PRESETS["h100-sxm"], ep_size=72, workload=Workload(context_len=2000)
    )
    return model, deepep_link("deepep-ll", 72)


def test_reproduces_sglang_decode_sign_and_32_tokens():
    """lmsys blog 2025-05-05: TBO -27 % at 32 decode tokens per device, +25.5 % at 256, a
    threshold "between 64 and 128 tokens", and 22,310 tokens/s per node with TBO at 256
    (256 / (22310 / 8) = 92 ms a step, so 115 ms without TBO). The deployment ran SGLang's own
    decode schedule (``schedule="sglang"``)."""
    model, link = sglang_decode_model()
    at_32 = predict(model, link, "decode", 32, [2], schedule="sglang").speedup[2]
    at_256 = predict(model, link, "decode", 256, [2], schedule="sglang")
    assert at_32 < 1 < at_256.speedup[2]
    assert abs(at_32 - 0.73) <= 0.10
    sweep = token_sweep(2, 512)
    assert 64 < crossover(model, link, "decode", [2], sweep, schedule="sglang") <= 128
    assert at_256.step_ms_off == pytest.approx(115, rel=0.15)
    assert at_256.step_ms_on[2] == pytest.approx(92, rel=0.15)


def test_reproduces_sglang_decode_256_tokens():
    model, link = sglang_decode_model()
    sglang = predict(model, link, "decode", 256, [2], schedule="sglang").speedup[2]
    assert abs(sglang - 1.255) <= 0.10
    # this engine's ring schedule on the same deployment hides more (the experts overlap the
    # other ubatch's combine): a prediction, not a published number
    assert predict(model, link, "decode", 256, [2]).speedup[2] > sglang + 0.1


def test_sglang_schedule_runs_two_batches_only():
    model, link = sglang_decode_model()
    with pytest.raises(ValueError, match="runs 2"):
        step_ms(model, link, "decode", 256, 3, schedule="sglang")
    with pytest.raises(ValueError, match="schedules are"):
        step_ms(model, link, "decode", 256, 2, schedule="pipeline")


def test_bucket_prior():
    model, link = sglang_decode_model()
    assert bucket_prior(model, link, "decode", 0) == 0.0  # 1 token cannot be cut in two
    t = round(2**8.5)
    expected = step_ms(model, link, "decode", t, 1) / step_ms(model, link, "decode", t, 2)
    assert bucket_prior(model, link, "decode", 8) == pytest.approx(expected)


def test_cli_prints_table_crossovers_and_sensitivity(capsys, tmp_path):
    prior = tmp_path / "prior.json"
    argv = [
        "--ep-size",
        "72",
        "--decode-tokens",
        "32,256",
        "--prefill-tokens",
        "4096",
        "--write-prior",
        str(prior),
    ]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "model: DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3 config.json)" in out
    assert "link: deepep-ll EP72" in out and "DeepEP docs/legacy.md" in out
    assert "overlap model: N ubatches take turns on the compute in a ring" in out
    for row in ("decode:32", "decode:256", "prefill:4096"):
        assert row in out
    assert "crossover decode: DBO pays >=" in out
    assert "recommended: --dbo-decode-token-threshold" in out
    assert "; matters most: " in out
    table = json.loads(prior.read_text())
    assert table["format"] == "moe-dbo adaptive prior v1" and "8" in table["decode"]


def test_cli_sglang_schedule(capsys):
    argv = ["--ep-size", "72", "--decode-tokens", "32,256", "--schedule", "sglang"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "overlap model: SGLang's two-batch overlap" in out
    assert "N=3" not in out  # two batches only
    assert "crossover decode: DBO pays >=" in out and "recommended:" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link-gbps", "1"], "--link-latency-us and --link-gbps go together"),
        (["--model", "nope"], "--model 'nope': not a preset"),
        (["--num-ubatches", "1,2"], "--num-ubatches values must be >= 2"),
        (["--ep-size", "1"], "argument --ep-size: expected an integer >= 2, got '1'"),
        (["--decode-tokens", "a"], "expected comma-separated integers"),
        (["--device", "tpu"], "--device 'tpu': unknown"),
        (
            ["--link-latency-us", "-1", "--link-gbps", "1"],
            "argument --link-latency-us: expected a finite number >= 0 (µs), got '-1'",
        ),
        # non-finite values: refused at parse time, before any prediction (they made every
        # speedup nan and still recommended thresholds)
        (
            ["--link-latency-us", "inf", "--link-gbps", "100"],
            "argument --link-latency-us: expected a finite number >= 0 (µs), got 'inf'",
        ),
        (
            ["--link-latency-us", "5", "--link-gbps", "nan"],
            "argument --link-gbps: expected a finite number > 0 (Gbit/s), got 'nan'",
        ),
        (["--link-latency-us", "5", "--link-gbps", "0"], "finite number > 0 (Gbit/s), got '0'"),
        (["--context-len", "0"], "argument --context-len: expected an integer >= 1, got '0'"),
        (["--prompt-len", "-3"], "argument --prompt-len: expected an integer >= 1, got '-3'"),
        (["--error-points", "nan"], "expected a finite number in [0, 100) (points), got 'nan'"),
        (["--schedule", "sglang", "--num-ubatches", "2,3"], "--num-ubatches must be 2"),
        (["--schedule", "sglang", "--calibrate", "x"], "--schedule sglang needs a preset model"),
        (["--error-points", "100"], "--error-points: expected a finite number in [0, 100)"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("launch.plan: error:")


def test_infinite_or_bad_links_are_refused():
    with pytest.raises(ValueError, match="must be > 0"):
        from_gbps(10, 0)
    assert math.isfinite(
        deepep_link("deepep-ll", 300).dispatch_gbytes
    )  # beyond the table: last row


def test_engine_reads_the_prior_and_refuses_a_bad_one(tmp_path):
    from launch.engine.arg_utils import EngineArgs

    model, link = sglang_decode_model()
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(prior_table(model, link)))
    prior = EngineArgs(dbo_adaptive_prior=str(path)).adaptive_prior()
    assert prior(Bucket(kind="decode", log2_tokens=8)) == pytest.approx(
        bucket_prior(model, link, "decode", 8), abs=1e-4
    )
    for text, message in (("{", "Expecting"), ('{"decode": [1]}', "must map")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"--dbo-adaptive-prior '{path}': .*{message}"):
            EngineArgs(dbo_adaptive_prior=str(path))
    with pytest.raises(ValueError, match="No such file"):
        EngineArgs(dbo_adaptive_prior=str(tmp_path / "missing.json"))


def test_this_machine_is_measured():
    from dbo.planning.devices import measure_this_machine

    device = measure_this_machine("fp32", seconds=0.05)
    assert device.peak_tflops["fp32"] > 0 and device.mem_tbps > 0 and device.kernel_us > 0
    assert "measured" in device.sources["all"]


@pytest.mark.parametrize("name", sorted(p.name for p in PRESETS.values()))
def test_every_preset_predicts_from_a_config_file(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[name.lower()].hf_config))
    shown, config = load_model(str(tmp_path))
    assert shown == str(tmp_path / "config.json")
    model = RooflineCostModel(config, DEVICE_PRESETS["h200"], ep_size=16)
    for kind, tokens in (("decode", 64), ("prefill", 4096)):
        p = predict(model, deepep_link("deepep-ht", 16), kind, tokens, [2, 3])
        assert p.step_ms_off > 0 and all(0 < s < 3 for s in p.speedup.values())
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_model(str(tmp_path))


def test_engine_starts_its_adaptive_policy_from_the_prior(tmp_path):
    from tests.helpers.single_rank import single_rank_engine

    path = tmp_path / "prior.json"
    path.write_text(json.dumps({"decode": {"6": 1.5}, "prefill": {}}))
    engine = single_rank_engine(None, dbo_adaptive_prior=str(path))
    prior = engine.model_runner.adaptive_policy.prior
    assert prior(Bucket(kind="decode", log2_tokens=6)) == 1.5
    assert prior(Bucket(kind="prefill", log2_tokens=6)) is None
