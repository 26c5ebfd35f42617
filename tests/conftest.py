"""Shared fixtures: a tiny Mixtral checkpoint saved by transformers, and prompts for it."""

from __future__ import annotations

import json
import os
import random

import pytest

# the helpers' asserts report their operands like the tests' own
pytest.register_assert_rewrite("tests.helpers")


def pytest_configure(config):
    # The suite tests the CPU platform wherever it runs (a machine with GPUs too): engines and
    # spawned ranks inherit this; GPU tests ask for CUDA themselves (tests/helpers/gpu.py).
    os.environ.setdefault("MOE_DBO_PLATFORM", "cpu")
    # Graph mode compiles seconds per graph: engines in tests run eagerly unless a test asks for
    # graph mode explicitly (--cudagraph-capture-sizes); inherited by spawned ranks and torchrun.
    os.environ.setdefault("MOE_DBO_GRAPH_MODE", "0")
    # Under pytest-xdist (-n N) every worker's torch would take all the cores, N times the
    # machine over, which can push multi-rank and server tests past their timeouts: the workers
    # share the cores instead.
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if num_workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // num_workers))
    # inductor's cache, per CPU capability (launch.engine.graph_mode.graph_cache_dir): a graph
    # compiled in an uncapped run returned wrong values in a run capped at AVX2 (.ci/run does both)
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        import tempfile

        from launch.engine.graph_mode import cpu_cache_subdir

        root = os.path.join(tempfile.gettempdir(), "moe-dbo-test-inductor", cpu_cache_subdir())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = root


@pytest.fixture(autouse=True)
def platform_default_attention_backend():
    """Every test starts on its platform's default attention backend: an engine sets the
    process-wide one from ``--attention-backend`` (read when an op is built), and ops a later
    test builds directly must not inherit it."""
    from moe.layers.attention_selector import set_attention_backend

    yield
    set_attention_backend(None)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Build (or load from torch's cache) the compiled CPU kernels once, before the first test:
    the first build takes ~20 s on 2 cores, and inside a multi-rank test it would count against
    that test's own timeouts; spawned ranks and torchrun then load the cached build."""
    from moe.kernels import cpu_kernels
    from moe.platforms import current_platform

    cpu_kernels(current_platform().cpu_capability().isa)


TINY_MIXTRAL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)


def make_tiny_mixtral(*, seed: int, **overrides):
    """transformers' MixtralForCausalLM on ``TINY_MIXTRAL`` (with ``overrides``), built offline.

    HF's init (std 0.02) makes every logit ~0, so matrices are redrawn with std 0.3 (embeddings
    1.0): logits of a few units make a 1e-5 comparison and greedy ties meaningful.
    """
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**TINY_MIXTRAL, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 1.0 if "embed" in name else 0.3)
    return model


# Tiny configs of the other architectures (transformers' config classes, built offline). Small
# enough for a fast suite, but each exercises its architecture's features: DeepSeek-V2 MLA without
# q_lora and group-limited routing, DeepSeek-V3 MLA with q_lora, yarn RoPE and noaux_tc routing,
# Qwen2-MoE's gated shared expert with a dense layer, OLMoE's q/k norms, Qwen3-MoE's per-head q/k
# norms with a head_dim of its own, attention biases and a dense layer by decoder_sparse_step. All
# have one dense or one sparse layer at least, 8 experts (divisible by EP 2 and 4), and eos ids
# outside the prompts.
_TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)
_MLA = dict(
    num_key_value_heads=4,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_group=4,
    topk_group=2,
)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "deepseek_v2": (
        "DeepseekV2",
        dict(
            _TINY_COMMON,
            **_MLA,
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3",
        dict(
            _TINY_COMMON,
            **_MLA,
            q_lora_rank=12,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(
            _TINY_COMMON,
            num_key_value_heads=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
    ),
    "olmoe": (
        "Olmoe",
        dict(_TINY_COMMON, num_key_value_heads=2, intermediate_size=16, num_experts=8),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            _TINY_COMMON,
            num_key_value_heads=2,
            head_dim=16,  # not hidden_size / num_attention_heads, as in Qwen3's checkpoints
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            attention_bias=True,
        ),
    ),
}


def make_tiny_model(model_type: str, *, seed: int, **overrides):
    """transformers' ``<Arch>ForCausalLM`` on ``TINY_CONFIGS[model_type]``, weights spread as in
    ``make_tiny_mixtral`` (DeepSeek-V3's correction bias drawn too, so it changes the routing)."""
    import torch
    import transformers

    prefix, kwargs = TINY_CONFIGS[model_type]
    config = getattr(transformers, f"{prefix}Config")(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 1.0 if "embed" in name else 0.3)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_arch_dirs(tmp_path_factory) -> dict[str, str]:
    """model_type -> directory of a float32 checkpoint saved by transformers (offline)."""
    dirs = {}
    for model_type in TINY_CONFIGS:
        path = tmp_path_factory.mktemp(model_type)
        make_tiny_model(model_type, seed=4321).save_pretrained(path, max_shard_size="40KB")
        dirs[model_type] = str(path)
    return dirs


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    """A sharded float32 Mixtral checkpoint from transformers' ``save_pretrained`` (offline)."""
    path = tmp_path_factory.mktemp("tiny_mixtral")
    make_tiny_mixtral(seed=1234).save_pretrained(path, max_shard_size="40KB")
    return str(path)


@pytest.fixture(scope="session")
def tiny_chat_dir(tiny_mixtral_dir, tmp_path_factory) -> str:
    """``tiny_mixtral_dir`` with a transformers-saved tokenizer and chat template (offline):
    token ``i`` is the word ``<i>`` (tests/helpers/chat.py)."""
    from tests.helpers.chat import checkpoint_with_chat_tokenizer

    return checkpoint_with_chat_tokenizer(tiny_mixtral_dir, tmp_path_factory.mktemp("chat") / "m")


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """Nine prompts of 3 to 20 tokens (ids 3..127, so none is the eos id 2)."""
    rng = random.Random(7)
    return [[rng.randrange(3, 128) for _ in range(n)] for n in (5, 12, 3, 20, 7, 9, 16, 4, 11)]


@pytest.fixture(scope="session")
def tiny_prompts_file(tmp_path_factory, tiny_prompts) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in tiny_prompts))
    return str(path)


def hf_greedy(model, prompts, *, max_new_tokens: int = 8, **generate_kwargs) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), up to eos."""
    import torch

    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **generate_kwargs,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="session")
def transformers_greedy(tiny_mixtral_dir, tiny_prompts) -> list[list[int]]:
    """transformers' greedy continuation (8 new tokens, stops at eos) of each prompt, one by one,
    in float64 (the engine runs that compare with it are float64 too: tokens equal on any CPU)."""
    from tests.helpers.precision import reference_model

    return hf_greedy(reference_model(tiny_mixtral_dir), tiny_prompts)
