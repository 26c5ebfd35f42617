"""KV cache sizing: --num-gpu-blocks-override wins, else a memory budget (--kv-cache-memory-bytes,
VLLM_CPU_KVCACHE_SPACE, 4 GiB default) capped at max-num-seqs full-length requests; hand-worked."""

from __future__ import annotations

import argparse

import pytest

from launch.engine.arg_utils import EngineArgs, human_readable_int
from launch.engine.kv_cache_sizing import GIB, size_kv_cache
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
    assert engine.memory.kv_cache_bytes == 20 * block_bytes
    assert "KV cache 20 blocks x 4 tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs 16 blocks"):  # max_model_len 64 / block size 4
        single_rank_engine(tiny_mixtral_dir, kv_cache_memory_bytes=15 * block_bytes)
