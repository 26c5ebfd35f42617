"""Checkpoint loading (sharded / single file, EP layouts, errors) and random initialisation."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from distributed import FusedMoEActivationFormat
from moe import (
    FusedMoEPrepareAndFinalize,
    MoEModelConfig,
    build_model,
    check_checkpoint,
    init_random_weights,
    load_checkpoint,
    load_config,
)

transformers = pytest.importorskip("transformers")

from tests.conftest import make_tiny_mixtral  # noqa: E402


class _EPStub(FusedMoEPrepareAndFinalize):
    """Serves num_local_experts for construction; loading never communicates."""

    def __init__(self, num_local_experts: int):
        self._n = num_local_experts

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    @property
    def num_local_experts(self) -> int:
        return self._n

    def prepare(self, *args, **kwargs):
        raise NotImplementedError

    def finalize(self, *args, **kwargs):
        raise NotImplementedError


def _build(config, ep_rank=0, ep_size=1):
    if ep_size == 1:
        return build_model(config)
    stub = _EPStub(config.num_experts // ep_size)
    return build_model(config, ep_rank=ep_rank, ep_size=ep_size, prepare_finalize=stub)


@pytest.fixture(scope="module")
def hf_model():
    return make_tiny_mixtral(seed=0, num_local_experts=4, max_position_embeddings=256)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, hf_model):
    path = tmp_path_factory.mktemp("sharded")
    hf_model.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory, hf_model):
    path = tmp_path_factory.mktemp("single")
    hf_model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


def _expected(path):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    files = (
        set(json.loads(index.read_text())["weight_map"].values())
        if index.exists()
        else {"model.safetensors"}
    )
    tensors = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


def test_config_from_checkpoint(sharded):
    config = load_config(sharded)
    assert config.head_dim == 8 and config.num_experts == 4 and config.rope_theta == 1e6
    assert config.eos_token_ids == (2,) and not config.tie_word_embeddings


@pytest.mark.parametrize("which", ["sharded", "single"])
def test_loads_every_tensor(which, request):
    path = request.getfixturevalue(which)
    tensors = _expected(path)
    model = _build(load_config(path))
    stats = load_checkpoint(model, path)
    assert set(stats.tensor_names) == set(tensors)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name, tensor in tensors.items():
        qkv = re.fullmatch(
            r"(?P<attn>.*self_attn)\.(?P<which>[qkv])_proj\.(?P<p>weight|bias)",
            name,
        )
        if ".experts." in name:
            prefix, e, w = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            torch.testing.assert_close(params[f"{prefix}.{w}"][e], tensor, rtol=0, atol=0)
        elif qkv:  # q, k, v stacked in this order along the rows of one qkv_proj
            q_size, kv_size, _ = modules[qkv["attn"]].qkv_sizes
            start = {"q": 0, "k": q_size, "v": q_size + kv_size}[qkv["which"]]
            merged = params[f"{qkv['attn']}.qkv_proj.{qkv['p']}"]
            torch.testing.assert_close(merged[start : start + len(tensor)], tensor, rtol=0, atol=0)
        else:
            torch.testing.assert_close(params[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_ep2_reads_only_owned_experts(sharded, ep_rank):
    tensors = _expected(sharded)
    model = _build(load_config(sharded), ep_rank=ep_rank, ep_size=2)
    stats = load_checkpoint(model, sharded)
    experts = model.model.layers[0].block_sparse_moe.experts
    assert experts.w1.shape == (2, 48, 32) and experts.w2.shape == (2, 32, 48)
    expert_names = {n for n in stats.tensor_names if ".experts." in n}
    owned = {2 * ep_rank, 2 * ep_rank + 1}
    assert {int(n.split(".")[-3]) for n in expert_names} == owned
    assert len(expert_names) == 2 * 3 * 2  # layers x (w1, w2, w3) x owned experts
    assert stats.num_tensors_read == len(tensors) - 2 * 3 * 2
    for local, e in enumerate(sorted(owned)):
        torch.testing.assert_close(
            experts.w3[local], tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"]
        )


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint directory .*nope.* does not exist"):
        load_config(tmp_path / "nope")


def test_missing_config(tmp_path, sharded):
    model = _build(load_config(sharded))
    with pytest.raises(FileNotFoundError, match=r"config\.json not found in .*"):
        load_checkpoint(model, tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(
        ValueError,
        match=r"supported architectures: \['DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM', "
        r"'MixtralForCausalLM', 'OlmoeForCausalLM', 'Qwen2MoeForCausalLM', 'Qwen3MoeForCausalLM'\]",
    ):
        load_config(tmp_path)


def test_corrupt_safetensors(tmp_path, single):
    path = tmp_path / "ckpt"
    shutil.copytree(single, path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_checkpoint(_build(load_config(path)), path)


def test_missing_shard(tmp_path, sharded):
    path = tmp_path / "ckpt"
    shutil.copytree(sharded, path)
    (path / "model-00003-of-00010.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00003-of-00010\.safetensors.* is missing"):
        load_checkpoint(_build(load_config(path)), path)


def test_missing_tensor(tmp_path, single):
    path = tmp_path / "ckpt"
    shutil.copytree(single, path)
    tensors = _expected(single)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight' is missing",
    ):
        load_checkpoint(_build(load_config(path)), path)


def test_shape_mismatch(tmp_path, single):
    path = tmp_path / "ckpt"
    shutil.copytree(single, path)
    tensors = _expected(single)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=(
            r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' .* "
            r"has shape \[8, 32\], expected \[16, 32\]"
        ),
    ):
        load_checkpoint(_build(load_config(path)), path)


def test_config_mismatch(single):
    config = load_config(single)
    other = MoEModelConfig(
        **{f: getattr(config, f) for f in config.__dataclass_fields__} | {"rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match=r"rope_theta: model=10000\.0 checkpoint=1000000\.0"):
        load_checkpoint(_build(other), single)


def test_random_init_is_identical_across_ep_layouts(single):
    config = load_config(single)
    full = _build(config)
    init_random_weights(full, seed=7)
    again = _build(config)
    init_random_weights(again, seed=7)
    for (name, a), (_, b) in zip(full.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    full_params = dict(full.named_parameters())
    for ep_rank in range(2):
        part = _build(config, ep_rank=ep_rank, ep_size=2)
        init_random_weights(part, seed=7)
        for name, p in part.named_parameters():
            if ".experts." in name:
                assert torch.equal(p, full_params[name][2 * ep_rank : 2 * ep_rank + 2]), name
            else:
                assert torch.equal(p, full_params[name]), name
    other = _build(config)
    init_random_weights(other, seed=8)
    assert not torch.equal(other.lm_head.weight, full.lm_head.weight)
    assert torch.equal(full.model.norm.weight, torch.ones(32))


def test_check_checkpoint_reads_headers_only(sharded, tmp_path):
    assert check_checkpoint(sharded) == load_config(sharded)
    path = tmp_path / "ckpt"
    shutil.copytree(sharded, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.block_sparse_moe.experts.0.w1.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight' is missing from checkpoint"):
        check_checkpoint(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_init_values_follow_the_seeded_formula(single, dtype):
    """Each matrix is randn(shape, generator seeded from (seed, name)) * fan_in**-0.5 in float32,
    cast: the values the embedded default has always had (written in place, no temporary)."""
    from moe.model_loader.loader import _seed_for, checkpoint_targets

    model = build_model(load_config(single), dtype=dtype)
    init_random_weights(model, seed=3)
    for name, target in checkpoint_targets(model):
        if target.dim() == 1:
            assert torch.equal(target, torch.ones_like(target)), name
            continue
        gen = torch.Generator().manual_seed(_seed_for(3, name))
        values = torch.randn(tuple(target.shape), generator=gen, dtype=torch.float32)
        assert torch.equal(target, (values * target.shape[-1] ** -0.5).to(dtype)), name


def test_build_skips_default_init_and_restores_it(single):
    from torch import nn

    from moe.models.registry import skip_default_init

    before = nn.Linear.reset_parameters
    with pytest.raises(RuntimeError, match="boom"), skip_default_init():
        linear = nn.Linear(4, 4)
        assert linear.weight.shape == (4, 4)  # built, nothing drawn
        raise RuntimeError("boom")
    assert nn.Linear.reset_parameters is before  # restored even after an error
    gen_state = torch.random.get_rng_state()
    build_model(load_config(single))
    assert torch.equal(torch.random.get_rng_state(), gen_state)  # no default init drew numbers


def test_random_init_on_the_device_is_seeded_per_tensor(single):
    """``on_device`` (``--load-format dummy``) draws in place with a generator on the weights'
    device: on the CPU in float32 that is the host formula itself; in bfloat16 its own values,
    the same for the same seed, with the formula's scale."""
    config = load_config(single)
    host, device = _build(config), _build(config)
    init_random_weights(host, seed=5)
    init_random_weights(device, seed=5, on_device=True)
    for (name, a), (_, b) in zip(host.named_parameters(), device.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    bf16 = [build_model(config, dtype=torch.bfloat16) for _ in range(2)]
    for model in bf16:
        init_random_weights(model, seed=5, on_device=True)
    w0, w1 = (m.lm_head.weight for m in bf16)
    assert torch.equal(w0, w1)
    std = float(w0.detach().float().std()) * w0.shape[-1] ** 0.5
    assert 0.8 < std < 1.2  # N(0, 1/fan_in)
