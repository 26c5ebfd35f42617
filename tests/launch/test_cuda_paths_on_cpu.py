"""The engine on the CUDA platform's code paths, run on CPU tensors: every op bound to its
``forward_cuda`` (the grouped-GEMM experts, batched attention), vLLM's transfer order under DBO,
two DP ranks with expert parallelism, DBO on and off, against transformers. What a GPU run
executes, minus the device: CI proves the paths' maths and the engine's wiring of them."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.engine import (
    assert_dbo_on_equals_off_equals_reference,
    dbo_test_engine_args,
    run_engine_steps,
)
from tests.helpers.precision import reference_model

ARCHS = ("mixtral", "deepseek_v3", "qwen3_moe")


def _cuda_ops_on_cpu():
    """``CudaPlatform`` placing ranks on the host: its op dispatch and transfer order, no device
    (no streams, no CUDA graphs, nothing to synchronise)."""
    from moe.platforms import CudaPlatform
    from moe.platforms.placement import host_placement

    class CudaOpsOnCpu(CudaPlatform):
        def place_rank(self, **kwargs):
            return host_placement()

        def synchronize(self, device):
            pass

        def describe_device(self, device):
            return str(device)

        def device_clock(self, device):
            return None

        def graph_backend(self):
            return None

    return CudaOpsOnCpu()


def _rank_fn(rank, world_size, model_dirs, prompts, attention_backend=None):
    from launch.engine.llm_engine import LLMEngine
    from moe.layers import flex_attention as flex_module
    from tests.helpers.gpu import placed_groups

    # flex_attention eagerly: inductor's CPU template cannot compile its dynamic shapes (on a
    # GPU the engine compiles it); the same block mask and mask function either way
    flex_module.compiled_flex_attention = lambda: flex_module.flex_attention
    platform = _cuda_ops_on_cpu()
    _, groups = placed_groups(platform, rank, world_size, timeout_s=60)
    results = {}
    for model_type in model_dirs:
        for enable_dbo in (True, False):
            args = dbo_test_engine_args(
                model_dirs[model_type],
                world_size,
                enable_dbo,
                attention_backend=attention_backend,
                num_gpu_blocks_override=64,  # eager flex_attention scores every cache slot
            )
            engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
            experts = [m for m in engine.model.modules() if type(m).__name__ == "TorchExperts"]
            assert {e.forward_path for e in experts} == {"forward_cuda"}
            assert engine.model_runner.platform.issue_before_recv_hook is False
            attention = [m for m in engine.model.modules() if type(m).__name__ == "PagedAttention"]
            assert {m.backend.value for m in attention} <= {args.attention_backend}
            results[model_type, enable_dbo] = run_engine_steps(
                engine, prompts, groups.dp_rank, groups.dp_size
            )
    return results


def _assert_equal_transformers(per_rank, dirs, prompts, label):
    for model_type, path in dirs.items():
        assert_dbo_on_equals_off_equals_reference(
            [r[model_type, True] for r in per_rank],
            [r[model_type, False] for r in per_rank],
            reference_model(path, torch.float32),
            prompts,
            label=f"{model_type} {label}",
            exact_reference=reference_model(path),
        )


@pytest.mark.slow
def test_cuda_op_paths_with_dp2_ep_dbo_equal_transformers(
    tiny_arch_dirs, tiny_mixtral_dir, tiny_prompts
):
    dirs = {**{a: tiny_arch_dirs[a] for a in ARCHS if a != "mixtral"}, "mixtral": tiny_mixtral_dir}
    per_rank = run_distributed(_rank_fn, 2, dirs, tiny_prompts, timeout_s=280)
    _assert_equal_transformers(per_rank, dirs, tiny_prompts, "on the CUDA op paths")


@pytest.mark.slow
def test_flex_attention_with_dp2_ep_dbo_equals_transformers(
    tiny_arch_dirs, tiny_mixtral_dir, tiny_prompts
):
    """``--attention-backend FLEX_ATTENTION`` (CUDA's GQA option) on the CUDA op paths: the GQA
    architectures, DBO on and off."""
    dirs = {"mixtral": tiny_mixtral_dir, "qwen3_moe": tiny_arch_dirs["qwen3_moe"]}
    per_rank = run_distributed(_rank_fn, 2, dirs, tiny_prompts, "FLEX_ATTENTION", timeout_s=280)
    _assert_equal_transformers(per_rank, dirs, tiny_prompts, "with FLEX_ATTENTION")
