"""The Platform: CPU capability detection and its cap, the probes, the answers each platform
gives, ``check_and_update_config`` through ``EngineArgs``, and an out-of-tree platform plugin
package installed into a temporary directory and run end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import NoEPPrepareAndFinalize
from launch.engine.arg_utils import EngineArgs
from moe import TorchExperts
from moe.compilation.backends import CUDAGraphPiece, InductorGraph
from moe.fused_moe.modular_kernel import FusedMoEModularKernel
from moe.platforms import (
    ComputeDtype,
    ConfigUpdate,
    CpuPlatform,
    CudaPlatform,
    Platform,
    current_platform,
    detect_cpu_capability,
    platform_for,
    set_current_platform,
)
from moe.platforms import interface as interface_mod
from moe.platforms.cpu_capability import (
    CpuCapability,
    grouped_mm_unavailable_reason,
    onednn_linear_unavailable_reason,
)
from moe.platforms.device_probes import is_host

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "tests" / "plugins" / "moe_dbo_test_platform"
CPUINFO = (
    "vendor_id\t: GenuineIntel\n"
    "model name\t: Test Xeon\n"
    "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
)


@pytest.fixture(autouse=True)
def _restore_platform():
    yield
    set_current_platform(None)


def _capability(tmp_path, environ, torch_capability, monkeypatch) -> CpuCapability:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: torch_capability)
    return detect_cpu_capability(environ=environ, cpuinfo_path=str(cpuinfo))


@pytest.mark.parametrize(
    ("torch_capability", "cap", "isa", "capped"),
    [
        ("AVX512", None, "avx512_bf16", None),  # the CPU's flags add avx512_bf16
        ("AVX512", "avx2", "avx2", "avx2"),
        ("AVX512", "AVX512", "avx512", "avx512"),
        ("AVX512", "avx512_bf16", "avx512_bf16", None),
        ("AVX2", "avx512", "avx2", None),  # a cap never raises the ISA
        ("AVX2", "none", "default", "default"),
        ("DEFAULT", None, "default", None),
        ("ZVECTOR", None, "default", None),
    ],
)
def test_isa_is_torchs_capped_by_our_variable(
    tmp_path, monkeypatch, torch_capability, cap, isa, capped
):
    environ = {} if cap is None else {"MOE_DBO_CPU_ISA": cap}
    capability = _capability(tmp_path, environ, torch_capability, monkeypatch)
    assert (capability.isa, capability.cap) == (isa, capped)
    assert (capability.vendor, capability.model_name) == ("GenuineIntel", "Test Xeon")
    assert capability.has_avx512_bf16 == capability.has_amx == (isa == "avx512_bf16")


def test_avx512_without_the_bf16_flag_stays_avx512(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.replace(" avx512_bf16 amx_tile", ""))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    capability = detect_cpu_capability(environ={}, cpuinfo_path=str(cpuinfo))
    assert capability.isa == "avx512" and not capability.has_avx512_bf16
    assert capability.describe() == "AVX-512 (GenuineIntel, Test Xeon)"


def test_describe_names_the_isa_extras_and_the_cap(tmp_path, monkeypatch):
    full = _capability(tmp_path, {}, "AVX512", monkeypatch)
    assert full.describe() == "AVX-512 + avx512_bf16 + AMX (GenuineIntel, Test Xeon)"
    capped = _capability(tmp_path, {"MOE_DBO_CPU_ISA": "avx2"}, "AVX512", monkeypatch)
    assert capped.describe() == "AVX2 (GenuineIntel, Test Xeon, capped by MOE_DBO_CPU_ISA=avx2)"


def test_a_bad_isa_cap_is_refused_naming_the_choices(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"MOE_DBO_CPU_ISA='sse9' is not one of \('default'"):
        _capability(tmp_path, {"MOE_DBO_CPU_ISA": "sse9"}, "AVX512", monkeypatch)


def test_unreadable_cpuinfo_gives_unknown(monkeypatch):
    capability = detect_cpu_capability(environ={}, cpuinfo_path="/nonexistent/cpuinfo")
    assert (capability.vendor, capability.model_name, capability.flags) == (
        "unknown",
        "unknown",
        frozenset(),
    )


def test_probes_answer_for_the_dtypes_every_cpu_has():
    # float32 oneDNN linears and grouped GEMMs run on every x86 CPU torch supports
    assert onednn_linear_unavailable_reason(torch.float32) is None
    assert grouped_mm_unavailable_reason(torch.float32) is None
    reason = onednn_linear_unavailable_reason(torch.float64)  # oneDNN has no float64 linear
    assert reason is not None and "float64" in reason


def test_cpu_platform_answers():
    cpu = CpuPlatform()
    placement = cpu.place_rank(local_rank=1, local_world_size=4)
    assert (placement.device, placement.dist_backend) == (torch.device("cpu"), "gloo")
    assert cpu.dispatch_key == "cpu" and cpu.issue_before_recv_hook is True
    assert cpu.make_ubatch_streams(2, torch.device("cpu")) is None
    assert cpu.graph_backend() is InductorGraph
    assert cpu.compute_dtype(torch.float32) == ComputeDtype(dtype=torch.float32)
    cuda = CudaPlatform()
    assert cuda.issue_before_recv_hook is False
    assert cuda.graph_backend() is CUDAGraphPiece


def test_a_devices_platform_answers_for_its_tensors():
    """``platform_for``: the current platform for its own device type, a built-in one for the
    host tensors of a CUDA process, an unclaimed one for ``meta``; forgotten with the current."""
    cuda = CudaPlatform()
    set_current_platform(cuda)
    try:
        assert platform_for(torch.device("cuda", 0)) is cuda
        host = platform_for(torch.device("cpu"))
        assert isinstance(host, CpuPlatform) and host.is_host_memory and not cuda.is_host_memory
        assert platform_for(torch.device("cpu")) is host  # resolved once per device type
        meta = platform_for(torch.device("meta"))
        assert meta.device_type == "meta" and not meta.is_host_memory
        assert not is_host(torch.device("meta")) and is_host(torch.device("cpu"))
        # host tensors of a CUDA process: ops run in issue order, Triton compiles for CUDA only
        assert cuda.make_ubatch_streams(2, torch.device("cpu")) is None
        assert cuda.is_triton_target and not host.is_triton_target
        assert "cuda" in cuda.profiler_kinds and "cuda" not in host.profiler_kinds
        plain = Platform()
        set_current_platform(plain)
        assert platform_for(torch.device("cpu")) is plain
    finally:
        set_current_platform(None)


def test_cuda_prepares_sdpa_without_cudnn_attention():
    # torch's flags exist on CPU builds too: the CUDA platform's choice is checked here
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        line = CudaPlatform().prepare_kernels()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert line.startswith("SDPA backends: flash, memory-efficient, math")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_bfloat16_runs_as_float32_exactly_where_the_probe_fails(monkeypatch):
    chosen = CpuPlatform().compute_dtype(torch.bfloat16)
    if onednn_linear_unavailable_reason(torch.bfloat16) is None:
        assert chosen == ComputeDtype(dtype=torch.bfloat16)
    else:
        assert chosen.dtype == torch.float32 and "no bfloat16 GEMM" in chosen.reason
    monkeypatch.setattr(interface_mod, "onednn_linear_unavailable_reason", lambda dtype: "test")
    forced = CpuPlatform().compute_dtype(torch.bfloat16)
    assert forced.dtype == torch.float32 and "(test)" in forced.reason


def test_float32_pack_limits_follow_the_vendor_and_isa(monkeypatch):
    def with_vendor(vendor, isa="avx512"):
        capability = CpuCapability(
            isa=isa,
            torch_capability=isa.upper()[:6],
            vendor=vendor,
            model_name="x",
            flags=frozenset(),
        )
        monkeypatch.setattr(CpuPlatform, "cpu_capability", lambda self: capability)
        return CpuPlatform().float32_pack_limits()

    intel, amd = with_vendor("GenuineIntel"), with_vendor("AuthenticAMD")
    assert (intel.max_rows, intel.min_elements) == (256, 1 << 20)
    assert amd.max_rows == sys.maxsize and amd.min_elements == 1 << 17
    zen3 = with_vendor("AuthenticAMD", isa="avx2")
    assert (zen3.max_rows, zen3.min_elements) == (64, 1 << 20)


class _NoGraphsPlatform(Platform):
    name = "no_graphs"
    supported_dtypes = (torch.float32, torch.float64)


def test_engine_args_apply_the_platforms_update_with_a_note():
    set_current_platform(_NoGraphsPlatform())
    args = EngineArgs(dtype="float32")
    assert args.enforce_eager is True
    assert args.platform_notes == ("graph mode off: platform no_graphs has no graph backend",)
    with pytest.raises(ValueError, match=r"--dtype torch.bfloat16 is not supported on no_graphs"):
        EngineArgs(dtype="bfloat16")


def test_a_platform_can_refuse_a_config_before_any_work():
    class Picky(CpuPlatform):
        def check_and_update_config(self, args) -> ConfigUpdate:
            if args.enable_dbo:
                raise ValueError("--enable-dbo is not supported on picky")
            return super().check_and_update_config(args)

    set_current_platform(Picky())
    with pytest.raises(ValueError, match="--enable-dbo is not supported on picky"):
        EngineArgs(data_parallel_size=2, enable_expert_parallel=True, enable_dbo=True)


def test_modular_kernel_takes_the_platforms_transfer_order():
    for platform, expected in ((CpuPlatform(), True), (CudaPlatform(), False)):
        set_current_platform(platform)
        experts = TorchExperts(num_local_experts=2, hidden_size=4, intermediate_size=4)
        kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=2), experts)
        assert kernel.issue_before_recv_hook is expected
    assert current_platform().name == "cuda"


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """The plugin package installed (pip, no network) into a directory of its own."""
    target = tmp_path_factory.mktemp("plugin_site")
    build = tmp_path_factory.mktemp("plugin_build")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            str(PLUGIN),
        ],
        check=True,
        timeout=240,
        cwd=build,
        capture_output=True,
    )
    return target


@pytest.mark.slow
def test_installed_plugin_platform_changes_the_engines_decisions(installed_plugin):
    """With the plugin active, one 1-rank generate run takes its answers: its kernels line, its
    compute dtype for a bfloat16 request, its config change and graph mode off (no backend)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(installed_plugin), str(REPO)]),
        "MOE_DBO_TEST_PLATFORM": "1",
    }
    env.pop("MOE_DBO_PLATFORM", None)  # the suite's pin to the CPU platform would win
    check = (
        "from moe.platforms import current_platform; from moe import TorchExperts;"
        "p = current_platform(); e = TorchExperts(num_local_experts=1, hidden_size=4, "
        "intermediate_size=4); print(p.name, p.issue_before_recv_hook, e.forward_path)"
    )
    probe = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.stdout.split() == ["plugin_cpu", "False", "forward_native"], probe.stderr
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "launch.generate",
        "--max-tokens",
        "4",
        "--dtype",
        "bfloat16",
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in (
        "moe-dbo: platform plugin_cpu:",
        "moe-dbo: graph mode off: platform plugin_cpu has no graph backend",
        "moe-dbo: --max-num-seqs capped at 8 by the plugin device",
        "moe-dbo: --dtype bfloat16 runs as float32: the plugin device computes in float32",
        "moe-dbo: plugin kernels ready",
    ):
        assert line in proc.stderr, proc.stderr[-3000:]


def test_the_plugin_stays_inactive_unless_enabled(installed_plugin):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed_plugin), str(REPO)])}
    env.pop("MOE_DBO_TEST_PLATFORM", None)
    env.pop("MOE_DBO_PLATFORM", None)
    check = "from moe.platforms import current_platform; print(current_platform().name)"
    proc = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() in ("cpu", "cuda"), proc.stderr
