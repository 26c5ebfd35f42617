"""The device flags without a GPU: ``--share-gpus`` and the refusal of more ranks than GPUs
before any process group exists, ``--load-format dummy`` on a config.json-only directory, and the
graph-mode split on the installed torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch.engine.arg_utils import EngineArgs, add_engine_args, engine_args_from_namespace
from moe.platforms import set_current_platform
from tests.helpers.gpu import fake_cuda_platform


@pytest.fixture
def one_fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    set_current_platform(fake_cuda_platform(1))
    yield
    set_current_platform(None)


def _parse(*argv: str) -> EngineArgs:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from_namespace(parser.parse_args(list(argv)))


def test_share_gpus_and_load_format_parse_with_vllms_spelling():
    args = _parse("--share-gpus", "--load-format", "dummy", "--dtype", "float32")
    assert args.share_gpus and args.load_format == "dummy"
    defaults = _parse("--dtype", "float32")
    assert not defaults.share_gpus and defaults.load_format == "auto"
    with pytest.raises(ValueError, match=r"--load-format 'npz' is not one of"):
        EngineArgs(load_format="npz", dtype="float32")


def test_two_ranks_on_one_gpu_are_refused_before_any_process_group(one_fake_gpu, monkeypatch):
    from launch.engine.startup import init_engine_groups

    for key, value in dict(
        RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29999")
    args = EngineArgs(data_parallel_size=2, dtype="float32", enforce_eager=True)
    with pytest.raises(ValueError, match=r"^2 ranks on this node but 1 CUDA device\(s\) visible"):
        init_engine_groups(args)
    assert not dist.is_initialized()


def test_a_config_json_alone_runs_with_load_format_dummy(tiny_mixtral_dir, tmp_path):
    from tests.helpers.single_rank import single_rank_engine

    shutil.copy(f"{tiny_mixtral_dir}/config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        single_rank_engine(str(tmp_path))
    engine = single_rank_engine(str(tmp_path), load_format="dummy", seed=7)
    config = json.loads((tmp_path / "config.json").read_text())
    assert engine.model.model.embed_tokens.weight.shape == (
        config["vocab_size"],
        config["hidden_size"],
    )
    from launch.engine.request import Request, SamplingParams

    engine.add_request(
        Request(
            request_id=0,
            prompt_token_ids=[3, 4, 5],
            sampling_params=SamplingParams(max_tokens=4),
        )
    )
    (finished,) = engine.run_until_done()
    assert len(finished.output_token_ids) == 4
    # seeded: the same seed gives the same weights, another seed other weights
    again = single_rank_engine(str(tmp_path), load_format="dummy", seed=7)
    other = single_rank_engine(str(tmp_path), load_format="dummy", seed=8)
    w = [e.model.lm_head.weight for e in (engine, again, other)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])


def test_a_config_too_large_for_the_rank_is_refused_before_any_allocation(
    tiny_mixtral_dir, tmp_path, monkeypatch
):
    """The parameter bytes per rank are known from config.json: a config no machine holds fails
    in one line naming them, before the model is built (10**9 experts used to fail only in torch's
    allocator, 10**6 after minutes of drawing weights); the real loader is checked alike."""
    import re

    from moe.platforms import current_platform
    from tests.helpers.single_rank import single_rank_engine

    config = json.loads((Path(tiny_mixtral_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 10**9}))
    with pytest.raises(ValueError) as refused:
        single_rank_engine(str(tmp_path), load_format="dummy")
    assert re.fullmatch(
        r"--load-format dummy: the parameters need [\d.]+ TiB per rank \(config\.json: 1000000000 "
        r"experts over 1 EP rank\(s\), 2 layers, hidden_size 32, vocab_size 128; float32\), "
        r"more than the [\d.]+ [KMGT]iB available",
        str(refused.value),
    )
    monkeypatch.setattr(type(current_platform()), "available_memory", lambda self, device: 2048)
    with pytest.raises(ValueError) as refused:
        single_rank_engine(tiny_mixtral_dir)
    message = str(refused.value)
    assert message.startswith(f"--model {tiny_mixtral_dir}: the parameters need ")
    assert message.endswith("; float32), more than the 2.0 KiB available")


def test_graph_mode_pieces_return_tuples_on_this_torch():
    """``split_forward`` gives every piece a tuple return whether or not this torch's
    ``split_module`` takes ``tuple_return`` (torch 2.11 does not)."""
    from torch import fx
    from torch.fx.passes.split_module import split_module

    from moe.compilation.pieces import _return_tuples

    def f(x, y):
        a = x + 1  # partition 0: one output
        b = a * y  # partition 1: one output
        return b, a

    traced = fx.symbolic_trace(f)
    parts = {"add": 0, "mul": 1}
    graph = split_module(traced, traced, lambda n: parts.get(n.name, 0), keep_original_order=True)
    _return_tuples(graph)
    for node in graph.graph.nodes:
        if node.op == "call_module":
            out = next(n for n in getattr(graph, node.target).graph.nodes if n.op == "output")
            assert isinstance(out.args[0], tuple)
    x, y = torch.randn(3), torch.randn(3)
    assert all(torch.equal(a, b) for a, b in zip(graph(x, y), f(x, y), strict=True))


def test_load_format_dummy_takes_a_preset_name_for_real_shapes():
    from moe.model_loader import resolve_model

    dummy = {"load_format": "dummy", "max_model_len": None, "seed": 0}

    olmoe = resolve_model("OLMoE-1B-7B", **dummy)
    c = olmoe.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok) == (
        16,
        2048,
        64,
        8,
    )
    qwen3 = resolve_model("qwen3-30b-a3b", **dummy)
    assert qwen3.config.num_experts == 128
    with pytest.raises(FileNotFoundError, match=r"nor a preset \(\['DeepSeek-V3', "):
        resolve_model("no-such-model", **dummy)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        resolve_model("OLMoE-1B-7B", **{**dummy, "load_format": "auto"})  # weights wanted
