"""KV cache sizing: --num-gpu-blocks-override wins, else a memory budget (--kv-cache-memory-bytes,
on a device --gpu-memory-utilization of its memory minus what a profile step leaves in use, on the
host VLLM_CPU_KVCACHE_SPACE or the 4 GiB default) capped at max-num-seqs full-length requests;
hand-worked, the device's memory faked (no GPU needed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from launch.engine.arg_utils import EngineArgs, human_readable_int
from launch.engine.kv_cache_sizing import GIB, device_memory_budget, size_kv_cache
from launch.engine.profile_run import profile_metadata, profile_run
from moe.platforms import CpuPlatform, CudaPlatform, DeviceMemory, set_current_platform
from tests.helpers.single_rank import single_rank_engine

# 1 KiB per token, blocks of 16 tokens = 16 KiB per block; max_model_len 100 -> 7 blocks a request
SHAPE = {"bytes_per_token": 1024, "block_size": 16, "max_model_len": 100}
NO_ENV: dict[str, str] = {}


def test_override_wins_over_every_budget():
    sizing = size_kv_cache(
        **SHAPE, max_num_seqs=4, num_gpu_blocks_override=3, kv_cache_memory_bytes=1, environ=NO_ENV
    )
    assert (sizing.num_blocks, sizing.block_bytes) == (3, 16 * 1024)
    assert "--num-gpu-blocks-override 3" in sizing.summary()


def test_budget_buys_whole_blocks():
    # 10 blocks and a half of budget -> 10 blocks (max-num-seqs 4 x 7 = 28 would be usable)
    sizing = size_kv_cache(
        **SHAPE, max_num_seqs=4, kv_cache_memory_bytes=10 * 16384 + 8192, environ=NO_ENV
    )
    assert sizing.num_blocks == 10 and sizing.num_bytes == 10 * 16384
    assert "--kv-cache-memory-bytes 172032" in sizing.summary()


def test_default_budget_is_capped_at_what_max_num_seqs_requests_use():
    sizing = size_kv_cache(**SHAPE, max_num_seqs=4, environ=NO_ENV)
    assert sizing.num_blocks == 4 * 7
    assert "default budget 4 GiB" in sizing.source and "capped at --max-num-seqs 4" in sizing.source


def test_default_budget_is_4_gib():
    # 1 MiB per token, 1-token blocks, huge max-num-seqs: the budget decides (4096 blocks)
    sizing = size_kv_cache(
        bytes_per_token=1 << 20, block_size=1, max_model_len=8, max_num_seqs=10**6, environ=NO_ENV
    )
    assert sizing.num_blocks == 4096 and sizing.num_bytes == 4 * GIB


def test_env_budget_in_gib_and_flag_over_env():
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    sizing = size_kv_cache(
        bytes_per_token=1 << 20, block_size=1, max_model_len=8, max_num_seqs=10**6, environ=env
    )
    assert sizing.num_blocks == 2048 and "VLLM_CPU_KVCACHE_SPACE=2 GiB" in sizing.source
    flag = size_kv_cache(**SHAPE, max_num_seqs=4, kv_cache_memory_bytes=7 * 16384, environ=env)
    assert flag.num_blocks == 7


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_env_budget_is_one_clear_error(value):
    with pytest.raises(ValueError, match=rf"VLLM_CPU_KVCACHE_SPACE must be .*'{value}'"):
        size_kv_cache(**SHAPE, max_num_seqs=4, environ={"VLLM_CPU_KVCACHE_SPACE": value})


def test_budget_below_one_request_names_need_and_flags():
    with pytest.raises(
        ValueError,
        match=r"holds 6 blocks .* max_model_len=100 tokens needs 7 blocks \(114688 bytes.*"
        r"raise --kv-cache-memory-bytes or lower --max-model-len",
    ):
        size_kv_cache(**SHAPE, max_num_seqs=4, kv_cache_memory_bytes=7 * 16384 - 1, environ=NO_ENV)


@pytest.mark.parametrize(
    ("text", "value"),
    [("123", 123), ("4G", 4 * GIB), ("2K", 2048), ("1.5g", 1_500_000_000), ("500m", 500 * 10**6)],
)
def test_human_readable_bytes(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5G", "4GB", "", "x"])
def test_human_readable_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer"):
        human_readable_int(text)


def test_engine_args_reject_non_positive_budget():
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes must be >= 1, got 0"):
        EngineArgs(kv_cache_memory_bytes=0)


def test_engine_allocates_the_budget_and_fails_early_below_one_request(tiny_mixtral_dir, capsys):
    """The engine allocates what the sizing chose, says so at start-up (rank 0, stderr), and a
    budget below one max-length request fails before the checkpoint is loaded."""
    probe = single_rank_engine(tiny_mixtral_dir, num_gpu_blocks_override=1)
    block_bytes = probe.kv_cache_sizing.block_bytes
    engine = single_rank_engine(tiny_mixtral_dir, kv_cache_memory_bytes=20 * block_bytes)
    assert engine.kv_cache_manager.num_blocks == 20
    assert engine.observability.memory.kv_cache_bytes == 20 * block_bytes
    assert "KV cache 20 blocks x 4 tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs 16 blocks"):  # max_model_len 64 / block size 4
        single_rank_engine(tiny_mixtral_dir, kv_cache_memory_bytes=15 * block_bytes)


def test_device_budget_is_the_utilization_of_total_minus_in_use():
    memory = DeviceMemory(total_bytes=100 * GIB, not_torch_bytes=2 * GIB, torch_peak_bytes=16 * GIB)
    budget, source = device_memory_budget(
        memory, gpu_memory_utilization=0.9, profile_num_tokens=8192
    )
    assert budget == int(0.9 * 100 * GIB) - 18 * GIB
    assert source == "0.90 x 100.0 GiB - 18.0 GiB in use after a profile step at 8192 tokens"
    # 72 GiB of 1 MiB blocks; the flag still wins over the device's budget
    shape = {"bytes_per_token": 1 << 20, "block_size": 1, "max_model_len": 8}
    sizing = size_kv_cache(**shape, max_num_seqs=10**6, device_budget=(budget, source))
    assert sizing.num_blocks == budget >> 20 and source in sizing.summary()
    flag = size_kv_cache(
        **shape, max_num_seqs=10**6, kv_cache_memory_bytes=GIB, device_budget=(budget, source)
    )
    assert flag.num_blocks == 1024 and "--kv-cache-memory-bytes" in flag.source
    # the device's budget replaces the host's env budget
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    on_device = size_kv_cache(
        **shape, max_num_seqs=10**6, environ=env, device_budget=(budget, source)
    )
    assert on_device.num_blocks == budget >> 20


def test_ranks_sharing_a_device_take_their_share_minus_their_own_peak():
    # two ranks on a 100 GiB device: 45 GiB each, minus this rank's 16 GiB peak; the other
    # rank's memory (in not_torch_bytes) is in its own share
    memory = DeviceMemory(
        total_bytes=100 * GIB, not_torch_bytes=40 * GIB, torch_peak_bytes=16 * GIB
    )
    budget, source = device_memory_budget(
        memory, gpu_memory_utilization=0.9, profile_num_tokens=64, num_ranks_on_device=2
    )
    assert budget == int(0.9 * 100 * GIB) // 2 - 16 * GIB
    assert source == (
        "0.90 x 100.0 GiB / 2 ranks on the device - 16.0 GiB this rank's peak after a profile "
        "step at 64 tokens"
    )


def test_device_budget_refuses_when_nothing_or_too_little_is_left():
    full = DeviceMemory(total_bytes=80 * GIB, not_torch_bytes=5 * GIB, torch_peak_bytes=70 * GIB)
    with pytest.raises(
        ValueError,
        match=r"no memory left for the KV cache: 0\.90 x 80\.0 GiB - 75\.0 GiB in use after a "
        r"profile step at 2048 tokens leaves -3\.00 GiB; raise --gpu-memory-utilization",
    ):
        device_memory_budget(full, gpu_memory_utilization=0.9, profile_num_tokens=2048)
    # 6 blocks left where one max_model_len request needs 7
    tight = DeviceMemory(total_bytes=10 * 16384, not_torch_bytes=16384, torch_peak_bytes=3 * 16384)
    budget = device_memory_budget(tight, gpu_memory_utilization=1.0, profile_num_tokens=16)
    with pytest.raises(
        ValueError, match=r"holds 6 blocks .*needs 7 blocks.*or --gpu-memory-utilization"
    ):
        size_kv_cache(**SHAPE, max_num_seqs=4, environ=NO_ENV, device_budget=budget)


def test_cuda_platform_reads_free_memory_and_the_allocator_peak(monkeypatch):
    """Driver view: 30 of 100 GiB in use, 20 of them reserved by torch's allocator (10 not
    torch's); the allocator's peak after the profile step 16 GiB -> 26 GiB in use."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 16 * GIB)
    memory = CudaPlatform().device_memory(torch.device("cuda", 0))
    assert memory == DeviceMemory(
        total_bytes=100 * GIB, not_torch_bytes=10 * GIB, torch_peak_bytes=16 * GIB
    )
    assert memory.in_use_bytes == 26 * GIB
    # host tensors of a CUDA process, and the CPU platform: the host's default sizing
    assert CudaPlatform().device_memory(torch.device("cpu")) is None
    assert CpuPlatform().device_memory(torch.device("cpu")) is None


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan")])
def test_engine_args_reject_gpu_memory_utilization_outside_0_1(value):
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\], got"):
        EngineArgs(gpu_memory_utilization=value)
    assert EngineArgs(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0


def test_profile_metadata_cuts_the_largest_batch_into_max_model_len_requests():
    metadata, num_blocks = profile_metadata(10, max_model_len=4, block_size=3)
    assert metadata.query_start_loc.tolist() == [0, 4, 8, 10]
    assert metadata.seq_lens.tolist() == [4, 4, 2] and num_blocks == 2 + 2 + 1
    assert metadata.block_table.tolist() == [[0, 1], [2, 3], [4, 0]]
    assert metadata.slot_mapping.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12, 13]


class _MemoryReportingCpu(CpuPlatform):
    """The CPU platform reporting a device's memory: the engine's free-memory path on the host.
    ``in_use_bytes`` is fixed; the profile step must have run when it is read."""

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self.calls: list[str] = []

    def reset_peak_memory(self, device):
        self.calls.append("reset")

    def device_memory(self, device):
        self.calls.append("read")
        return self.memory


def test_engine_sizes_the_cache_from_reported_memory_after_a_profile_step(
    tiny_mixtral_dir, capsys, monkeypatch
):
    from launch.engine import kv_cache_sizing

    def spy(model, **kwargs):
        platform.calls.append(f"profile {kwargs['num_tokens']} tokens")
        return profile_run(model, **kwargs)

    monkeypatch.setattr(kv_cache_sizing, "profile_run", spy)
    probe = single_rank_engine(tiny_mixtral_dir, num_gpu_blocks_override=1)
    block_bytes = probe.kv_cache_sizing.block_bytes
    platform = _MemoryReportingCpu(
        DeviceMemory(total_bytes=100 * block_bytes, not_torch_bytes=0, torch_peak_bytes=0)
    )
    set_current_platform(platform)
    try:
        capsys.readouterr()
        engine = single_rank_engine(
            tiny_mixtral_dir, gpu_memory_utilization=0.5, max_num_batched_tokens=100
        )
        # 50 blocks of budget; max_num_seqs 64 x 16 blocks would use more
        assert engine.kv_cache_manager.num_blocks == 50
        assert engine.observability.memory.kv_cache_bytes == 50 * block_bytes
        # decided, then the peak reset, the profile step at the token budget, the memory read
        assert platform.calls == ["read", "reset", "profile 100 tokens", "read"]
        err = capsys.readouterr().err
        assert "KV cache 50 blocks x 4 tokens" in err
        assert "in use after a profile step at 100 tokens" in err
        # the flag overrides the device's memory: no profile step
        platform.calls.clear()
        flagged = single_rank_engine(tiny_mixtral_dir, kv_cache_memory_bytes=20 * block_bytes)
        assert flagged.kv_cache_manager.num_blocks == 20 and "reset" not in platform.calls
        # too little left for one max_model_len (64 tokens = 16 blocks) request
        platform.memory = DeviceMemory(
            total_bytes=30 * block_bytes, not_torch_bytes=0, torch_peak_bytes=0
        )
        with pytest.raises(ValueError, match=r"holds 15 blocks .*needs 16 blocks"):
            single_rank_engine(tiny_mixtral_dir, gpu_memory_utilization=0.5)
    finally:
        set_current_platform(None)
