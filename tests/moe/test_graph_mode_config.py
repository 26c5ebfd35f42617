"""Graph-mode settings: buckets, vLLM's flag spellings, padding (no compilation here)."""

from __future__ import annotations

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


def test_resolve_capture_sizes():
    assert resolve_capture_sizes([8, 2, 8], max_capture_size=None, max_num_batched_tokens=64) == (
        2,
        8,
    )
    assert (
        resolve_capture_sizes(None, max_capture_size=None, max_num_batched_tokens=10_000)
        == DEFAULT_CAPTURE_SIZES
    )
    assert resolve_capture_sizes(None, max_capture_size=None, max_num_batched_tokens=20) == (
        1,
        2,
        4,
        8,
        16,
    )
    assert resolve_capture_sizes(None, max_capture_size=192, max_num_batched_tokens=20)[-2:] == (
        160,
        192,
    )
    with pytest.raises(ValueError, match=r"integers >= 1, got \[0, 4\]"):
        resolve_capture_sizes([0, 4], max_capture_size=None, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="exceed --max-cudagraph-capture-size 8"):
        resolve_capture_sizes([4, 16], max_capture_size=8, max_num_batched_tokens=64)


def test_bucket_for_picks_smallest_bucket_that_fits():
    sizes = (1, 4, 16)
    assert [bucket_for(n, sizes) for n in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, None]


def test_parse_compilation_config():
    assert parse_compilation_config('{"cudagraph_capture_sizes": [1, 2]}') == {
        "cudagraph_capture_sizes": (1, 2)
    }
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
    monkeypatch.delenv("MOE_DBO_GRAPH_MODE")  # the default: eager unless sizes are given
    assert _args().graph_capture_sizes() == ()
    assert _args("--cudagraph-capture-sizes", "4").graph_capture_sizes() == (4,)


def test_pad_rows():
    x = torch.arange(6.0).view(3, 2)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2) and torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(x, 3) is x
