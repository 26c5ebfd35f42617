"""``--profiler-config`` (vLLM's keys): parsing and its refusals before any work, the step window
(``delay_iterations`` / ``max_iterations``), the platform's activities and device range, traces
written by the offline API and by 2 DP ranks under DBO (the ubatch threads' ops included), and
the server's ``/start_profile`` / ``/stop_profile`` in process."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from launch.engine.arg_utils import EngineArgs
from launch.engine.profiler import (
    ProfilerConfig,
    RangeStepProfiler,
    StepProfiler,
    TorchStepProfiler,
    all_threads_config,
    make_step_profiler,
    parse_profiler_config,
)
from launch.serving.api_server import ServerConfig, build_app
from launch.serving.engine_bridge import EngineBridge, ServerShuttingDown
from launch.serving.metrics import ServerMetrics
from moe.platforms.interface import CpuPlatform, CudaPlatform
from tests.helpers.generate import torchrun


def _torch_config(directory, **extra) -> str:
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(directory), **extra})


def _trace_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def _traces(directory: Path, rank: int) -> list[Path]:
    return sorted(directory.glob(f"rank{rank}.*.pt.trace.json*"))


# parsing: vLLM's keys and rules, one line naming what is wrong


def test_a_torch_config_parses_with_vllms_defaults_and_an_absolute_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # restored after the test: later tests start from the repository
    config = parse_profiler_config('{"profiler": "torch", "torch_profiler_dir": "traces"}')
    assert config.torch_profiler_dir == str(tmp_path / "traces")
    assert config.torch_profiler_with_stack and config.torch_profiler_use_gzip
    assert not config.torch_profiler_record_shapes and config.max_iterations == 0
    assert parse_profiler_config('{"profiler": "cuda", "max_iterations": 3}').max_iterations == 3
    assert not parse_profiler_config("{}").is_on


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('["torch"]', "must be a JSON object"),
        ('{"profiler": "torch", "torch_profiler_dir": "d", "with_stack": true}', "supported: "),
        ('{"profiler": "nsight"}', "is not one of ['torch', 'cuda']"),
        ('{"profiler": "torch"}', 'needs "torch_profiler_dir"'),
        ('{"profiler": "cuda", "torch_profiler_dir": "d"}', 'applies only to profiler "torch"'),
        ('{"profiler": "cuda", "max_iterations": -1}', "max_iterations=-1 must be an integer >= 0"),
        ('{"profiler": "cuda", "delay_iterations": true}', "must be an integer >= 0"),
        ('{"profiler": "cuda", "delay_iterations": 1.5}', "must be an integer >= 0"),
        ('{"profiler": 1}', "profiler=1 must be str | None"),
        (
            '{"profiler": "torch", "torch_profiler_dir": "d", "torch_profiler_use_gzip": "no"}',
            "torch_profiler_use_gzip='no' must be bool",
        ),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(text, message):
    with pytest.raises(ValueError, match="--profiler-config") as info:
        EngineArgs(profiler_config=text)
    assert message in str(info.value)


def test_vllms_older_variable_arms_a_torch_profiler_and_the_flag_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    from_variable = EngineArgs().profiler()
    assert from_variable.profiler == "torch"
    assert from_variable.torch_profiler_dir == str(tmp_path / "env")
    flag = EngineArgs(profiler_config=_torch_config(tmp_path / "flag")).profiler()
    assert flag.torch_profiler_dir == str(tmp_path / "flag")
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "")
    assert not EngineArgs().profiler().is_on


def test_a_cuda_profiler_is_refused_on_a_platform_without_a_device_range():
    with pytest.raises(ValueError, match='profiler "cuda" needs a CUDA device range; platform cpu'):
        EngineArgs(profiler_config='{"profiler": "cuda"}')


def test_the_platform_hands_out_the_activities_and_the_device_range():
    cpu, cuda = CpuPlatform(), CudaPlatform()
    assert cpu.profiler_activities() == [torch.profiler.ProfilerActivity.CPU]
    assert torch.profiler.ProfilerActivity.CUDA in cuda.profiler_activities()
    assert cpu.profiler_range() is None
    assert cuda.profiler_range() == (torch.cuda.profiler.start, torch.cuda.profiler.stop)
    config = parse_profiler_config('{"profiler": "cuda"}')
    profiler = make_step_profiler(config, rank=0, platform=cuda)  # built, never started here
    assert isinstance(profiler, RangeStepProfiler)
    torch_config = parse_profiler_config(_torch_config("/tmp/x"))
    on_cpu = make_step_profiler(torch_config, rank=1, platform=cpu)
    assert isinstance(on_cpu, TorchStepProfiler) and on_cpu.activities == cpu.profiler_activities()
    assert make_step_profiler(ProfilerConfig(), rank=0, platform=cpu) is None


# the step window


class _Recorded(StepProfiler):
    """Records when the window opens and closes, by step."""

    def __init__(self, **config) -> None:
        super().__init__(ProfilerConfig(profiler="cuda", **config), rank=0)
        self.events: list[tuple[str, int]] = []

    def _begin(self) -> None:
        self.events.append(("begin", self._num_steps))

    def _end(self) -> None:
        self.events.append(("end", self._num_steps))


def test_the_window_opens_after_the_delay_and_closes_after_max_iterations():
    profiler = _Recorded(delay_iterations=2, max_iterations=3)
    profiler.step()  # not started: not counted
    profiler.start()
    profiler.start()  # a second start while armed does nothing
    for _ in range(8):
        profiler.step()
    assert profiler.events == [("begin", 2), ("end", 5)]  # steps 3, 4 and 5 recorded
    assert profiler.is_armed and not profiler.is_recording
    profiler.stop()  # closes nothing more
    profiler.stop()
    assert profiler.events == [("begin", 2), ("end", 5)] and not profiler.is_armed


def test_without_limits_the_window_is_start_to_stop_and_can_open_again():
    profiler = _Recorded()
    profiler.stop()  # never started: nothing
    profiler.start()
    profiler.step()
    profiler.stop()
    profiler.start()
    profiler.stop()
    assert profiler.events == [("begin", 0), ("end", 1), ("begin", 0), ("end", 0)]


def test_a_trace_lost_at_max_iterations_is_reported_and_the_steps_go_on(capsys):
    class _Failing(_Recorded):
        def _end(self) -> None:
            raise OSError("disk full")

    profiler = _Failing(max_iterations=1)
    profiler.start()
    profiler.step()  # ends the window: the write fails, the step does not
    profiler.step()
    assert not profiler.is_recording
    err = capsys.readouterr().err
    assert "[rank 0] the profiler stopped after max_iterations but could not write" in err
    assert "OSError: disk full" in err


def test_a_device_range_opens_and_closes_with_the_window():
    calls = []
    config = ProfilerConfig(profiler="cuda", max_iterations=2)
    profiler = RangeStepProfiler(
        config, rank=0, begin=lambda: calls.append("start"), end=lambda: calls.append("stop")
    )
    profiler.start()
    assert calls == ["start"]
    profiler.step()
    profiler.step()
    assert calls == ["start", "stop"]


def test_a_stop_during_the_delay_records_nothing():
    profiler = _Recorded(delay_iterations=5)
    profiler.start()
    profiler.step()
    profiler.stop()
    assert profiler.events == [] and not profiler.is_armed


# the engine through the offline API (one rank, in process)


def test_the_offline_api_writes_a_trace_of_the_recorded_steps(tmp_path, tiny_mixtral_dir):
    from launch.engine.request import SamplingParams
    from launch.offline.llm import LLM

    out = tmp_path / "traces"
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(out),
        "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False,
        "delay_iterations": 1,
        "max_iterations": 3,
    }
    llm = LLM(
        tiny_mixtral_dir, dtype="float32", max_model_len=64, block_size=4, profiler_config=config
    )
    try:
        with pytest.raises(ValueError, match="profile prefix '../x' must be"):
            llm.start_profile("../x")
        llm.start_profile("decode")
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        llm.stop_profile()  # closed by max_iterations already: writes nothing more
    finally:
        llm.shutdown()
    (trace,) = out.glob("decode_rank0.*.pt.trace.json")
    assert trace.suffix == ".json"  # torch_profiler_use_gzip false
    names = Counter(e.get("name") for e in _trace_events(trace) if e.get("ph") == "X")
    assert names["step"] == 3  # max_iterations, after the first step (delay_iterations)
    # vLLM's step annotation: the three recorded steps decode the one request
    assert names["execute_context_0(0)_generation_1(1)"] == 3
    assert names["layer0.attention"] == 3 and names["layer0.experts"] == 3
    assert any(name.startswith("aten::") for name in names)
    table = (out / "profiler_out_0.txt").read_text()
    assert "Self CPU" in table and "step" in table


def test_start_profile_without_a_config_names_the_flag(tiny_mixtral_dir):
    from launch.offline.llm import LLM

    llm = LLM(tiny_mixtral_dir, dtype="float32", max_model_len=64, block_size=4)
    try:
        with pytest.raises(RuntimeError, match="profiling is off: start the engine with"):
            llm.start_profile()
        llm.stop_profile()  # nothing to stop: no error
    finally:
        llm.shutdown()


def test_an_unwritable_trace_directory_is_refused_before_the_engine_starts(tiny_mixtral_dir):
    from launch.offline.llm import LLM

    config = {"profiler": "torch", "torch_profiler_dir": "/proc/moe-dbo-traces"}
    with pytest.raises(OSError, match="--profiler-config torch_profiler_dir '/proc/moe-dbo-tr"):
        LLM(tiny_mixtral_dir, profiler_config=config)


# 2 DP ranks with DBO: every rank's trace, with the ops of the ubatch threads


@pytest.mark.slow
def test_two_ranks_under_dbo_write_one_trace_each_with_the_ubatch_threads(
    tmp_path, tiny_mixtral_dir, tiny_prompts_file
):
    out = tmp_path / "traces"
    config = _torch_config(out, torch_profiler_with_stack=False, max_iterations=4)
    proc = torchrun(
        2,
        f"--model={tiny_mixtral_dir}",
        f"--prompts={tiny_prompts_file}",
        f"--output={tmp_path / 'out.jsonl'}",
        "--data-parallel-size=2",
        "--enable-expert-parallel",
        "--enable-dbo",
        "--dbo-decode-token-threshold=2",
        "--dbo-prefill-token-threshold=2",
        "--dtype=float32",
        "--max-tokens=8",
        f"--profiler-config={config}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"moe-dbo: torch profiler wrote {out}/rank0." in proc.stderr
    for rank in (0, 1):
        (trace,) = _traces(out, rank)
        assert trace.suffix == ".gz"
        spans = [e for e in _trace_events(trace) if e.get("ph") == "X"]
        assert sum(e["name"] == "step" for e in spans) == 4
        executions = [e["name"] for e in spans if e["name"].startswith("execute_context_")]
        assert len(executions) == 4 and all("_generation_" in name for name in executions)
        step_threads = {e["tid"] for e in spans if e["name"] == "step"}
        experts_threads = {e["tid"] for e in spans if e["name"] == "layer0.experts"}
        if all_threads_config() is not None:  # this torch records every thread
            # the forward ran on the ubatch threads (two per microbatched step), not the main one
            assert len(experts_threads) >= 2 and not experts_threads & step_threads
        assert (out / f"profiler_out_{rank}.txt").is_file()


# the server's routes, in process (aiohttp test server; the test plays the engine loop)


def _server_config(*, profiling: bool, api_keys: tuple[str, ...] = (), **extra) -> ServerConfig:
    return ServerConfig(
        model_name="m",
        max_model_len=64,
        vocab_size=128,
        tokenizer=None,
        metrics=ServerMetrics(dp_size=1),
        profiling=profiling,
        api_keys=api_keys,
        **extra,
    )


def _profile_requests(
    profiling: bool, answer, *, api_keys=(), headers=None, **config
) -> list[tuple[str, int, str]]:
    """POST /start_profile then /stop_profile while ``answer(bridge, order)`` plays rank 0's
    loop; (path, status, body) of each."""

    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        results = []
        app = build_app(_server_config(profiling=profiling, api_keys=api_keys, **config), bridge)
        async with TestClient(TestServer(app)) as client:
            for path in ("/start_profile", "/stop_profile"):
                pending = asyncio.ensure_future(client.post(path, headers=headers))
                for _ in range(200):  # until the order is in the hand-over (or the 404)
                    await asyncio.sleep(0.005)
                    bridge.take(0)
                    orders = bridge.take_profile_orders()
                    if orders or pending.done():
                        break
                for order in orders:
                    answer(bridge, order)
                response = await pending
                results.append((path, response.status, await response.text()))
        return results

    return asyncio.run(go())


def test_the_profile_routes_answer_200_once_the_engine_loop_resolved_the_order():
    seen = []

    def apply(bridge, order):
        seen.append(order.action)
        bridge.finish_profile_order(order, None)

    results = _profile_requests(True, apply)
    assert [(path, status, body) for path, status, body in results] == [
        ("/start_profile", 200, ""),
        ("/stop_profile", 200, ""),
    ]
    assert seen == ["start", "stop"]


def test_a_failed_order_answers_500_and_shutdown_503():
    def fail(bridge, order):
        error = OSError("disk full") if order.action == "start" else ServerShuttingDown("bye")
        bridge.finish_profile_order(order, error)

    (start, stop) = _profile_requests(True, fail)
    assert start[1] == 500 and "start_profile failed: OSError: disk full" in start[2]
    assert stop[1] == 503 and "bye" in stop[2]


def test_an_order_nobody_answers_times_out_with_504():
    results = _profile_requests(True, lambda bridge, order: None, output_timeout_s=0.2)
    assert [status for _, status, _ in results] == [504, 504]
    assert "start_profile: no answer in 0.2 s" in results[0][2]


def test_with_an_api_key_the_profile_routes_need_it():
    def apply(bridge, order):
        bridge.finish_profile_order(order, None)

    refused = _profile_requests(True, apply, api_keys=("k",))
    assert [status for _, status, _ in refused] == [401, 401]
    keyed = _profile_requests(True, apply, api_keys=("k",), headers={"Authorization": "Bearer k"})
    assert [status for _, status, _ in keyed] == [200, 200]


def test_without_a_profiler_config_the_routes_do_not_exist():
    results = _profile_requests(False, lambda bridge, order: None)
    assert [status for _, status, _ in results] == [404, 404]


def test_an_order_resolves_with_every_ranks_report_and_the_first_ranks_error():
    """The serve loop answers an order when every rank's next report says how applying it went
    (a stop's answer means every rank's trace is written)."""
    from types import SimpleNamespace

    from launch.serving.serve_loop import RankReport, ServeLoop

    class Bridge:
        finished: list = []

        def finish_profile_order(self, order, error):
            self.finished.append((order, None if error is None else str(error)))

    engine = SimpleNamespace(args=SimpleNamespace(load_balance_method="round_robin"))
    loop = ServeLoop(
        engine=engine,
        control_group=None,
        dp_rank=0,
        dp_size=2,
        stop_requested=lambda: False,
        shutdown_timeout_s=1,
        bridge=Bridge(),
    )
    loop._profile_orders_sent = ["start", "stop"]  # stand-ins for the two ProfileOrders
    reports = [
        RankReport(profile_errors=(None, None)),
        RankReport(profile_errors=(None, "[rank 1] OSError: disk full")),
    ]
    loop._finish_profile_orders(reports)
    assert loop.bridge.finished == [("start", None), ("stop", "[rank 1] OSError: disk full")]
    assert loop._profile_orders_sent == []


def test_fail_all_fails_the_profile_orders_still_in_the_hand_over():
    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        done = bridge.profile("start")
        bridge.fail_all(ServerShuttingDown("stopping"))
        with pytest.raises(ServerShuttingDown, match="stopping"):
            await asyncio.wait_for(done, 5)
        bridge.stop_accepting()
        with pytest.raises(ServerShuttingDown):
            bridge.profile("stop")

    asyncio.run(go())
