"""The engine on a CUDA device (tests marked ``gpu``; skipped without CUDA): every parameter and
the KV cache on the device and no matrix product on the host; float64 and float32 logits equal
transformers' for Mixtral, DeepSeek-V3 and Qwen2-MoE; CUDA graphs equal eager; two ranks sharing
one GPU with DP+EP+DBO equal DBO off and transformers; a bfloat16 decode step attends without
cuDNN's per-shape attention; a profile records the CUDA kernels; without a KV flag the cache takes
the free memory a profile step leaves. The logits, profile and
shared-device tests run on the CPU too (the same code with the CPU platform), so CI checks their
own logic; the op recorders are checked on the CPU, where they must find the host's products and
SDPA's CPU kernel. FLEX_ATTENTION's logits equal transformers' on the GPU, compiled (its CPU
tests run it eagerly)."""

from __future__ import annotations

import pytest
import torch

from launch.engine.kv_cache_sizing import DEFAULT_KV_CACHE_MEMORY_BYTES
from tests.helpers.engine import NUM_DECODE_STEPS, run_engine_steps
from tests.helpers.gpu import attention_ops, builtin_platform, device_platform, host_matmuls
from tests.helpers.precision import (
    FLOAT32_REL,
    assert_equals_transformers,
    assert_logits_close,
    assert_same_sums,
    reference_model,
)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GPU_ARCHS = ("mixtral", "deepseek_v3", "qwen2_moe")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the device type a test runs on: the host (CI), or CUDA (marked gpu, skipped without a GPU)
DEVICE_TYPES = ["cpu", pytest.param("cuda", marks=(pytest.mark.gpu, NEEDS_CUDA))]


def _engine(model_dir: str, device: torch.device, **overrides):
    from distributed import single_process_groups
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.llm_engine import LLMEngine

    args = EngineArgs(
        **{
            "model": model_dir,
            "dtype": "float32",
            "max_model_len": 64,
            "block_size": 4,
            # several engines live in one test process (the start-up freezes the heap): with the
            # free-memory rule the first would take the device (tested alone below)
            "kv_cache_memory_bytes": DEFAULT_KV_CACHE_MEMORY_BYTES,
            **overrides,
        }
    )
    groups = single_process_groups(timeout_s=60, device=device)
    return LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)


def _one_decode_step(engine) -> None:
    from launch.engine.request import Request, SamplingParams

    engine.add_request(
        Request(request_id=0, prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams())
    )
    engine.step()  # the prefill


def test_the_host_matmul_detector_finds_the_cpus_products(tiny_mixtral_dir):
    engine = _engine(tiny_mixtral_dir, torch.device("cpu"), enforce_eager=True)
    _one_decode_step(engine)
    assert host_matmuls(engine.step)  # a CPU engine multiplies on the host


def test_the_attention_op_recorder_sees_sdpas_cpu_kernel():
    q = torch.randn(2, 4, 3, 8)
    mask = torch.zeros(2, 1, 3, 3)
    ops = attention_ops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, mask))
    # one SDPA backend kernel (flash or math, by torch version), the op a GPU's test reads
    assert len(ops) == 1 and ops[0].startswith("aten::_scaled_dot_product"), ops


@pytest.mark.gpu
@NEEDS_CUDA
def test_a_bfloat16_decode_step_attends_without_cudnn(tiny_mixtral_dir):
    # cuDNN's fused attention builds a graph per shape, and decode shapes change every step
    # (CudaPlatform.prepare_kernels): the engine's SDPA calls must take another kernel
    with device_platform():
        engine = _engine(tiny_mixtral_dir, torch.device("cuda", 0), dtype="bfloat16")
        _one_decode_step(engine)
        ops = attention_ops(engine.step)
    assert ops and not any("cudnn" in op for op in ops), ops


@pytest.mark.gpu
@NEEDS_CUDA
def test_everything_lives_on_the_gpu_and_a_decode_step_multiplies_nothing_on_the_host(
    tiny_mixtral_dir,
):
    with device_platform():
        engine = _engine(tiny_mixtral_dir, torch.device("cuda", 0), dtype="bfloat16")
        tensors = {**dict(engine.model.named_parameters()), **dict(engine.model.named_buffers())}
        assert {t.device.type for t in tensors.values()} == {"cuda"}
        caches = [layer.kv_cache for layer in engine.model.attention_layers]
        assert {c.device.type for c in caches} == {"cuda"}
        _one_decode_step(engine)
        assert host_matmuls(engine.step) == []


@pytest.mark.gpu
@NEEDS_CUDA
def test_the_kv_cache_takes_the_free_memory_a_profile_step_leaves(tiny_mixtral_dir):
    """Without a KV flag the cache gets --gpu-memory-utilization of the device minus what is in
    use after the profile step (a small fraction here: the engine outlives the test)."""
    with device_platform():
        device = torch.device("cuda", 0)
        total = torch.cuda.mem_get_info(device)[1]
        engine = _engine(
            tiny_mixtral_dir,
            device,
            kv_cache_memory_bytes=None,
            gpu_memory_utilization=0.05,
            max_num_seqs=100_000,  # no cap: the memory decides
            max_num_batched_tokens=1024,
        )
        sizing = engine.kv_cache_sizing
        assert "in use after a profile step at 1024 tokens" in sizing.source
        assert 0 < sizing.num_bytes <= 0.05 * total
        assert engine.observability.memory.kv_cache_bytes == sizing.num_bytes
        assert torch.cuda.max_memory_allocated(device) <= 0.05 * total
        _one_decode_step(engine)


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_a_profile_of_a_decode_step_records_the_devices_kernels(
    tmp_path, tiny_mixtral_dir, device_type
):
    """``--profiler-config``: the platform's activities, so CUDA kernels on a GPU (and an op
    table by device time), the host's ops on a CPU."""
    import gzip
    import json

    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    with device_platform(device_type):
        engine = _engine(tiny_mixtral_dir, torch.device(device_type, 0), profiler_config=config)
        _one_decode_step(engine)
        engine.observability.start_profile()
        engine.step()
        engine.observability.stop_profile()
    (trace,) = tmp_path.glob("rank0.*.pt.trace.json.gz")
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert any(e.get("name") == "layer0.experts" for e in events)
    table = (tmp_path / "profiler_out_0.txt").read_text()
    if device_type == "cuda":
        assert kernels and "Self CUDA" in table.splitlines()[1], table[:400]
    else:
        assert not kernels and "Self CPU" in table


def _logits_on(device_type: str, model_dir: str, dtype: str):
    with device_platform(device_type):
        engine = _engine(model_dir, torch.device(device_type, 0), dtype=dtype, enforce_eager=True)
        return run_engine_steps(engine, PROMPTS, 0, 1)


@pytest.fixture(scope="module")
def gpu_arch_dirs(tiny_arch_dirs, tiny_mixtral_dir) -> dict[str, str]:
    """model_type -> checkpoint directory for every one of ``GPU_ARCHS``."""
    return {**tiny_arch_dirs, "mixtral": tiny_mixtral_dir}


def _assert_close_to_transformers(model_dir, logits, tokens, check, prompts=PROMPTS):
    """``check(ours, reference)`` on each prompt's logit rows against transformers' float64
    logits of prompt + generated tokens."""
    exact = reference_model(model_dir)
    for index, rows in logits.items():
        full = torch.tensor([prompts[index] + tokens[index]])
        with torch.no_grad():
            ref = exact(full).logits[0, : rows.shape[0]].double()
        check(torch.from_numpy(rows).double(), ref)


def _float32_check(ours, reference):
    assert_logits_close(ours, reference, rel=FLOAT32_REL)


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
@pytest.mark.parametrize("model_type", GPU_ARCHS)
def test_logits_equal_transformers_in_float64_and_float32(gpu_arch_dirs, model_type, device_type):
    model_dir = gpu_arch_dirs[model_type]
    logits64, tokens64, _ = _logits_on(device_type, model_dir, "float64")
    _assert_close_to_transformers(
        model_dir,
        logits64,
        tokens64,
        lambda ours, ref: assert_equals_transformers(
            ours, ref, model_type=model_type, device_type=device_type
        ),
    )
    logits32, tokens32, _ = _logits_on(device_type, model_dir, "float32")
    # float32 greedy tokens follow float64's except at near-ties, which the logit bound covers
    _assert_close_to_transformers(model_dir, logits32, tokens32, _float32_check)
    assert all(len(t) == NUM_DECODE_STEPS for t in tokens32.values())


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_graphs_equal_eager(tiny_mixtral_dir):
    with device_platform():
        device = torch.device("cuda", 0)
        eager = run_engine_steps(
            _engine(tiny_mixtral_dir, device, enforce_eager=True), PROMPTS, 0, 1
        )
        graphs = run_engine_steps(
            _engine(tiny_mixtral_dir, device, cudagraph_capture_sizes=(1, 2, 4, 8, 16)),
            PROMPTS,
            0,
            1,
        )
    assert graphs[1] == eager[1]  # tokens
    for index, rows in eager[0].items():
        bound = 64 * torch.finfo(torch.float32).eps * float(abs(rows).max())
        torch.testing.assert_close(graphs[0][index], rows, rtol=0, atol=bound)


@pytest.mark.gpu
@NEEDS_CUDA
def test_flex_attention_logits_equal_transformers(tiny_mixtral_dir):
    """``--attention-backend FLEX_ATTENTION``: flex_attention compiled on the GPU (once per
    process; its shapes change every step), eager and between CUDA graph pieces; float32 logits
    within the float32 bound of transformers' float64 ones. The 40-token prompt fills a tile of
    16 rows after its first block, so the prefill has a full block (no mask function)."""
    prompts = [*PROMPTS, list(range(20, 60))]
    for graphs in ({"enforce_eager": True}, {"cudagraph_capture_sizes": (1, 2, 4, 8, 16)}):
        with device_platform():
            engine = _engine(
                tiny_mixtral_dir,
                torch.device("cuda", 0),
                attention_backend="FLEX_ATTENTION",
                block_size=16,
                **graphs,
            )
            logits, tokens, _ = run_engine_steps(engine, prompts, 0, 1)
        _assert_close_to_transformers(tiny_mixtral_dir, logits, tokens, _float32_check, prompts)


def _shared_device_rank(rank, world_size, device_type, model_dir, prompts):
    from launch.engine.llm_engine import LLMEngine
    from tests.helpers.engine import dbo_test_engine_args
    from tests.helpers.gpu import placed_groups

    platform = builtin_platform(device_type)
    placement, groups = placed_groups(platform, rank, world_size, timeout_s=60)
    results = {}
    for enable_dbo in (True, False):
        args = dbo_test_engine_args(
            model_dir,
            world_size,
            enable_dbo,
            dtype="float64",
            kv_cache_memory_bytes=DEFAULT_KV_CACHE_MEMORY_BYTES,  # two engines per process
        )
        engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
        results[enable_dbo] = run_engine_steps(engine, prompts, groups.dp_rank, groups.dp_size)
    return placement.dist_backend, str(placement.device), results


@pytest.mark.slow
@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_two_ranks_sharing_one_device_with_dbo_equal_dbo_off_and_transformers(
    tiny_mixtral_dir, tiny_prompts, device_type
):
    from tests.helpers.distributed import run_distributed
    from tests.helpers.engine import assert_dbo_on_equals_off_equals_reference

    # tiny_prompts: every rank has at least the thresholds' tokens in every step, so each
    # DBO-on step is microbatched (PROMPTS' one-request share of rank 1 would vote no)
    per_rank = run_distributed(
        _shared_device_rank, 2, device_type, tiny_mixtral_dir, tiny_prompts, timeout_s=300
    )
    device = "cuda:0" if device_type == "cuda" else "cpu"
    assert [(b, d) for b, d, _ in per_rank] == [("gloo", device)] * 2
    # against the host's reference: on CUDA, its float32 steps (precision.py); on against off:
    # exact on either device
    assert_dbo_on_equals_off_equals_reference(
        [r[True] for _, _, r in per_rank],
        [r[False] for _, _, r in per_rank],
        reference_model(tiny_mixtral_dir),
        tiny_prompts,
        model_type="mixtral",
        device_type=device_type,
    )
    for _, _, results in per_rank:
        for index, on in results[True][0].items():
            off = results[False][0][index]
            assert_same_sums(on, off, msg=f"prompt {index}")


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_available_memory_is_what_the_device_can_give(device_type):
    """The memory check's answer (``Platform.available_memory``): on a GPU its free memory, at
    most its total; on the host (and for host tensors of a CUDA process) the host's."""
    import os

    platform = builtin_platform(device_type)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    free = platform.available_memory(device)
    if device_type == "cuda":
        assert 0 < free <= torch.cuda.get_device_properties(device).total_memory
    host = platform.available_memory(torch.device("cpu"))
    assert 0 < host <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
