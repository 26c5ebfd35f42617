"""DeepSeek-V2/V3, Qwen2-MoE and OLMoE (and Mixtral) vs transformers on one rank, per architecture.

Tiny checkpoints are built and saved by transformers inside the test (``tests.conftest``). Teacher
forcing through the paged cache as in ``test_mixtral_vs_transformers``: a batched prefill of two
prompts, then four decode steps (these exercise MLA's absorbed decode path; the prefill its
expanded path). float64 logits must match transformers' float64 ones within ``reference_rel`` of the
largest |logit| (1e-9, or 2**-17 where transformers keeps a float32 step whose rounding order is
not ours: DeepSeek-V2's complex64 rotation, DeepSeek-V3's float32 router GEMM), with ``--custom-ops
none`` (every op on forward_native) and ``all`` (CPU paths, cached RoPE table) alike; float32 with
``all`` (the grouped-GEMM experts, which take no float64) within 2**-14
(``tests.helpers.precision``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from distributed import NoEPPrepareAndFinalize  # noqa: E402
from moe import (  # noqa: E402
    MoEModelConfig,
    build_model,
    config_parameter_bytes,
    load_checkpoint,
    load_config,
    parameter_bytes,
    set_custom_ops,
)
from tests.conftest import TINY_CONFIGS, make_tiny_model  # noqa: E402
from tests.helpers.attention_metadata import BLOCK_SIZE, make_paged_metadata  # noqa: E402
from tests.helpers.precision import (  # noqa: E402
    FLOAT32_REL,
    assert_equals_transformers,
    assert_logits_close,
    assert_same_sums,
    reference_model,
)

ARCHS = list(TINY_CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type in ARCHS:
        path = tmp_path_factory.mktemp(model_type)
        make_tiny_model(model_type, seed=0).save_pretrained(path, max_shard_size="20KB")
        out[model_type] = (path, reference_model(path))
    return out


def _teacher_forced(model, seqs, prompt_lens, num_decode):
    """Logit rows of every prompt position, then one row per decode step, per request."""
    block_tables = [[5, 2, 9], [11, 0]]
    ids = torch.cat([s[:n] for s, n in zip(seqs, prompt_lens, strict=True)])
    pos = torch.cat([torch.arange(n) for n in prompt_lens])
    logits = model.compute_logits(
        model(ids, pos, make_paged_metadata(prompt_lens, prompt_lens, block_tables))
    )
    rows = [[logits[:7]], [logits[7:10]]]
    for step in range(num_decode):
        seq_lens = [n + step + 1 for n in prompt_lens]
        ids = torch.stack([s[n - 1] for s, n in zip(seqs, seq_lens, strict=True)])
        pos = torch.tensor([n - 1 for n in seq_lens])
        logits = model.compute_logits(
            model(ids, pos, make_paged_metadata([1, 1], seq_lens, block_tables))
        )
        for r in range(2):
            rows[r].append(logits[r : r + 1])
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("model_type", ARCHS)
def test_teacher_forced_logits_match_transformers_with_custom_ops_all_and_none(
    checkpoints, model_type
):
    path, ref = checkpoints[model_type]
    gen = torch.Generator().manual_seed(1)
    prompt_lens, num_decode = [7, 3], 4
    seqs = [torch.randint(3, 128, (n + num_decode,), generator=gen) for n in prompt_lens]
    with torch.no_grad():
        expected = [ref(input_ids=s[None]).logits[0] for s in seqs]
    results = {}
    try:
        for custom_ops, dtype in (
            ("all", torch.float64),
            ("none", torch.float64),
            ("all", torch.float32),
        ):
            set_custom_ops(custom_ops)
            model = build_model(load_config(path), dtype=dtype)
            load_checkpoint(model, path)
            model.allocate_kv_caches(16, BLOCK_SIZE)
            paths = {m.forward_path for m in model.modules() if hasattr(m, "forward_path")}
            assert paths == (
                {"forward_native"} if custom_ops == "none" else {"forward_native", "forward_cpu"}
            )
            results[custom_ops, dtype] = _teacher_forced(model, seqs, prompt_lens, num_decode)
    finally:
        set_custom_ops("all")
    for r, n in enumerate(prompt_lens):
        reference = expected[r][: n + num_decode]
        exact = results["all", torch.float64][r]
        assert_equals_transformers(exact, reference, model_type=model_type)
        assert_same_sums(results["none", torch.float64][r], exact)
        assert_logits_close(results["all", torch.float32][r], reference, rel=FLOAT32_REL)


def test_configs_parse_each_architecture(checkpoints):
    v2 = load_config(checkpoints["deepseek_v2"][0])
    assert (v2.attention_type, v2.topk_method, v2.scoring_func, v2.moe_layers) == (
        "mla",
        "group_limited_greedy",
        "softmax",
        (False, True),
    )
    assert v2.q_lora_rank is None and v2.shared_intermediate_size == 32 and v2.rope_interleave
    v3 = load_config(checkpoints["deepseek_v3"][0])
    assert (v3.topk_method, v3.scoring_func, v3.norm_topk_prob, v3.routed_scaling_factor) == (
        "noaux_tc",
        "sigmoid",
        True,
        2.5,
    )
    assert v3.rope_scaling_dict["factor"] == 4.0 and v3.q_lora_rank == 12
    qwen = load_config(checkpoints["qwen2_moe"][0])
    assert qwen.moe_layers == (False, True) and qwen.has_shared_expert_gate and qwen.qkv_bias
    olmoe = load_config(checkpoints["olmoe"][0])
    assert olmoe.qk_norm and olmoe.shared_intermediate_size == 0
    qwen3 = load_config(checkpoints["qwen3_moe"][0])  # transformers writes num_local_experts
    assert qwen3.moe_layers == (False, True) and qwen3.num_experts == 8 and qwen3.head_dim == 16
    assert qwen3.qk_norm and qwen3.qk_norm_per_head and qwen3.shared_intermediate_size == 0
    assert qwen3.qkv_bias and qwen3.o_bias and qwen3.norm_topk_prob
    attn = build_model(qwen3, device="meta").model.layers[0].self_attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)  # one head's width


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_qwen_sparse_step_and_mlp_only_layers(model_type):
    raw = json.loads(json.dumps(TINY_CONFIGS[model_type][1]))
    raw.update(
        model_type=model_type, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    config = MoEModelConfig.from_hf_config(raw)
    # sparse where (i + 1) % 2 == 0 and i not in mlp_only_layers
    assert config.moe_layers == (False, True, False, False, False, True)
    with pytest.raises(ValueError, match=f"{model_type} with use_sliding_window=true"):
        MoEModelConfig.from_hf_config({**raw, "use_sliding_window": True})


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, r"rope_type 'dynamic'"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq 2 is not supported"),
        ({"n_group": 3}, r"n_group \(3\) must be >= 1 and divide num_experts \(8\)"),
    ],
)
def test_bad_deepseek_configs_are_refused(change, pattern):
    raw = {**TINY_CONFIGS["deepseek_v2"][1], "model_type": "deepseek_v2", **change}
    with pytest.raises(ValueError, match=pattern):
        build_model(MoEModelConfig.from_hf_config(raw), device="meta")


class _FakePrepareFinalize(NoEPPrepareAndFinalize):
    """Serves ``num_local_experts`` (building an EP rank's model without process groups)."""


@pytest.mark.parametrize("model_type", ARCHS)
def test_each_rank_reads_only_its_routed_experts_and_holds_1_over_ep_bytes(checkpoints, model_type):
    path, _ = checkpoints[model_type]
    config = load_config(path)
    full = build_model(config, dtype=torch.float32)
    full_bytes = parameter_bytes(full)
    for ep_size in (2, 4):
        for ep_rank in range(ep_size):
            model = build_model(
                config,
                ep_rank=ep_rank,
                ep_size=ep_size,
                prepare_finalize=_FakePrepareFinalize(num_experts=config.num_experts // ep_size),
            )
            stats = load_checkpoint(model, path)
            owned = range(ep_rank * 8 // ep_size, (ep_rank + 1) * 8 // ep_size)
            read_experts = {
                int(name.split(".experts.")[1].split(".")[0])
                for name in stats.tensor_names
                if ".experts." in name
            }
            assert read_experts == set(owned)
            per_rank = parameter_bytes(model)
            assert per_rank["routed_experts"] * ep_size == full_bytes["routed_experts"] > 0
            for category in ("attention", "dense", "shared_experts", "router", "embedding"):
                assert per_rank[category] == full_bytes[category]


@pytest.mark.parametrize("model_type", ARCHS)
def test_config_parameter_bytes_equal_the_built_models(checkpoints, model_type):
    """The bytes a config's model holds per rank, known before anything is built (the memory
    check of ``--load-format dummy`` and the loader), equal the built model's count, with EP
    sharding, in each dtype, and with other numbers and orders of dense and sparse layers."""
    config = load_config(checkpoints[model_type][0])
    n = config.num_hidden_layers
    mixed = (False, True, True, False, True)
    for shape in (
        config,
        dataclasses.replace(config, num_hidden_layers=5, moe_layers=mixed),
        dataclasses.replace(config, num_hidden_layers=3, moe_layers=(False,) * 3),
        dataclasses.replace(config, num_hidden_layers=n + 1, moe_layers=(True,) * (n + 1)),
    ):
        for ep_size, dtype in ((1, torch.float32), (2, torch.bfloat16), (4, torch.float64)):
            local = _FakePrepareFinalize(num_experts=shape.num_experts // ep_size)
            built = build_model(
                shape, ep_size=ep_size, prepare_finalize=local, dtype=dtype, device="meta"
            )
            predicted = config_parameter_bytes(shape, ep_size=ep_size, dtype=dtype)
            assert predicted == parameter_bytes(built)


def test_kv_bytes_per_token_mla_stores_latent_and_rope_key(checkpoints):
    v2 = build_model(load_config(checkpoints["deepseek_v2"][0]), device="meta")
    # 2 layers x (kv_lora_rank 16 + qk_rope_head_dim 4) x 4 bytes; expanded K/V would be 2 x 4 x 20
    assert v2.kv_cache_bytes_per_token(torch.float32) == 2 * 20 * 4
    assert v2.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 20 * 2
    qwen = build_model(load_config(checkpoints["qwen2_moe"][0]), device="meta")
    assert qwen.kv_cache_bytes_per_token(torch.float32) == 2 * (2 * 2 * 8) * 4  # K+V, 2 kv heads
    caches = build_model(load_config(checkpoints["deepseek_v3"][0])).allocate_kv_caches(3, 4)
    assert [tuple(c.shape) for c in caches] == [(3, 4, 20)] * 2
