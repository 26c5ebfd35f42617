"""Graph-mode settings: the mode, buckets, vLLM's flag spellings, padding (no compilation here)."""

from __future__ import annotations

import functools

import pytest
import torch

from launch.engine.arg_utils import EngineArgs, engine_args_from_namespace
from launch.generate import build_parser
from moe.compilation import (
    DEFAULT_CAPTURE_SIZES,
    bucket_for,
    pad_rows,
    parse_compilation_config,
    resolve_capture_sizes,
)
from moe.compilation.config import cpu_capture_sizes, vllm_capture_sizes
from moe.platforms import CpuPlatform, CudaPlatform, set_current_platform


def _cpu(max_num_batched_tokens):
    return functools.partial(cpu_capture_sizes, max_num_batched_tokens=max_num_batched_tokens)


def test_resolve_capture_sizes():
    resolve = resolve_capture_sizes
    assert resolve([8, 2, 8], max_capture_size=None, default_sizes=_cpu(64)) == (2, 8)
    assert resolve(None, max_capture_size=None, default_sizes=_cpu(10_000)) == DEFAULT_CAPTURE_SIZES
    assert resolve(None, max_capture_size=None, default_sizes=_cpu(20)) == (1, 2, 4, 8, 16)
    assert resolve(None, max_capture_size=192, default_sizes=_cpu(20))[-2:] == (160, 192)
    with pytest.raises(ValueError, match=r"integers >= 1, got \[0, 4\]"):
        resolve([0, 4], max_capture_size=None, default_sizes=_cpu(64))
    with pytest.raises(ValueError, match="exceed --max-cudagraph-capture-size 8"):
        resolve([4, 16], max_capture_size=8, default_sizes=_cpu(64))
    with pytest.raises(ValueError, match="--max-cudagraph-capture-size must be >= 1, got 0"):
        resolve(None, max_capture_size=0, default_sizes=_cpu(64))


def test_vllm_capture_sizes_reach_max_num_seqs():
    """1, 2, 4, then multiples of 8 up to min(512, max_num_seqs, max_num_batched_tokens), the
    limit itself included: a decode step of max_num_seqs requests always has a graph."""
    sizes = vllm_capture_sizes(None, max_num_seqs=256, max_num_batched_tokens=8192)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:], strict=False))
    assert len(vllm_capture_sizes(None, max_num_seqs=1024, max_num_batched_tokens=8192)) == 67
    assert vllm_capture_sizes(None, max_num_seqs=1024, max_num_batched_tokens=8192)[-1] == 512
    assert vllm_capture_sizes(None, max_num_seqs=100, max_num_batched_tokens=8192)[-2:] == (96, 100)
    assert vllm_capture_sizes(None, max_num_seqs=256, max_num_batched_tokens=3) == (1, 2, 3)
    assert vllm_capture_sizes(20, max_num_seqs=8, max_num_batched_tokens=64)[-2:] == (16, 20)


def test_bucket_for_picks_smallest_bucket_that_fits():
    sizes = (1, 4, 16)
    assert [bucket_for(n, sizes) for n in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, None]


def test_parse_compilation_config():
    assert parse_compilation_config('{"cudagraph_capture_sizes": [1, 2]}') == {
        "cudagraph_capture_sizes": (1, 2)
    }
    assert parse_compilation_config('{"cudagraph_mode": "PIECEWISE"}') == {
        "cudagraph_mode": "PIECEWISE"
    }
    with pytest.raises(ValueError, match=r"cudagraph_mode must be one of .*got 'FULL'"):
        parse_compilation_config('{"cudagraph_mode": "FULL"}')
    with pytest.raises(ValueError, match=r"keys \['level'\] are not supported"):
        parse_compilation_config('{"level": 3}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_compilation_config("{")
    with pytest.raises(ValueError, match="list of integers"):
        parse_compilation_config('{"cudagraph_capture_sizes": 4}')


def _args(*argv: str) -> EngineArgs:
    return engine_args_from_namespace(build_parser().parse_args(list(argv)))


def test_graph_flags_with_vllm_spellings(monkeypatch):
    monkeypatch.setenv("MOE_DBO_GRAPH_MODE", "1")
    assert _args("--cudagraph-capture-sizes", "8", "4", "4").graph_capture_sizes() == (4, 8)
    cc = _args("-cc", '{"cudagraph_capture_sizes": [2, 32]}')
    assert cc.graph_capture_sizes() == (2, 32)
    assert _args("--enforce-eager").graph_capture_sizes() == ()
    assert _args().graph_capture_sizes() == DEFAULT_CAPTURE_SIZES  # on where the variable says so
    with pytest.raises(ValueError, match="mutually exclusive"):
        _args("--cudagraph-capture-sizes", "4", "-cc", '{"cudagraph_capture_sizes": [2]}')
    with pytest.raises(ValueError, match=r"integers >= 1, got \[-1\]"):
        _args("--cudagraph-capture-sizes", "-1")
    monkeypatch.setenv("MOE_DBO_GRAPH_MODE", "0")  # the test suite's setting
    assert _args().graph_capture_sizes() == ()
    monkeypatch.delenv("MOE_DBO_GRAPH_MODE")  # the CPU's default: eager unless sizes are given
    assert _args().graph_capture_sizes() == () and _args().cudagraph_mode == "NONE"
    assert _args("--cudagraph-capture-sizes", "4").graph_capture_sizes() == (4,)
    assert _args("--cudagraph-capture-sizes", "4").cudagraph_mode == "PIECEWISE"
    assert _args("-cc", '{"cudagraph_mode": "PIECEWISE"}').graph_capture_sizes()[-1] == 128
    with pytest.raises(ValueError, match=r"FULL_AND_PIECEWISE does not run on this platform; "):
        _args("-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}')


@pytest.fixture
def cuda_platform():
    set_current_platform(CudaPlatform())
    try:
        yield
    finally:
        set_current_platform(None)


def test_the_cuda_platform_runs_graphs_by_default_up_to_max_num_seqs(cuda_platform, monkeypatch):
    """On CUDA (the platform's answer, not a device string): FULL_AND_PIECEWISE with vLLM's
    buckets up to --max-num-seqs unless --enforce-eager; the suite's MOE_DBO_GRAPH_MODE=0 wins."""
    monkeypatch.delenv("MOE_DBO_GRAPH_MODE", raising=False)
    args = _args("--max-num-seqs", "256")
    assert args.cudagraph_mode == "FULL_AND_PIECEWISE"
    assert args.graph_capture_sizes() == vllm_capture_sizes(
        None, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens
    )
    assert args.graph_capture_sizes()[-1] == 256
    eager = _args("--enforce-eager")
    assert eager.cudagraph_mode == "NONE" and eager.graph_capture_sizes() == ()
    piecewise = _args("-cc", '{"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 16}')
    assert piecewise.cudagraph_mode == "PIECEWISE"
    assert piecewise.graph_capture_sizes() == (1, 2, 4, 8, 16)
    monkeypatch.setenv("MOE_DBO_GRAPH_MODE", "0")
    assert _args().cudagraph_mode == "NONE"


def test_a_platform_without_graph_backend_turns_graphs_off(monkeypatch):
    class NoGraphs(CpuPlatform):
        graph_modes = ("NONE",)

        def graph_backend(self):
            return None

    monkeypatch.setenv("MOE_DBO_GRAPH_MODE", "1")
    set_current_platform(NoGraphs())
    try:
        args = _args("--cudagraph-capture-sizes", "4")
        assert args.cudagraph_mode == "NONE" and args.enforce_eager
        assert args.graph_capture_sizes() == ()
    finally:
        set_current_platform(None)


def test_pad_rows():
    x = torch.arange(6.0).view(3, 2)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2) and torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(x, 3) is x
