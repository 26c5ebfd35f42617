"""Graph mode equals eager mode: same greedy tokens, logits within float32 rounding.

Engines on the transformers-built tiny Mixtral (2 DP ranks, EP; DBO on, so each ubatch thread runs
its own bucket's compiled graphs, and off) and on the embedded default model (1 rank, buckets
small enough that the prefill runs eagerly above the largest one), each against an eager engine
of the same process. Tolerance: float32 graphs reorder sums (fused kernels, another GEMM blocking
for a padded row count), so each layer's result may differ by a few float32 ulps of its magnitude;
over the logits' magnitude (|logit| < ~8 here) and a handful of layers that is below
``64 * eps_f32 * max|logit|`` (~6e-5); tokens must be identical (no near-ties in these prompts,
which the assertion would reveal).
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers.distributed import run_distributed

GRAPH_SIZES = (8, 64)
NUM_STEPS = 3  # prefill + 2 decode steps


def _engine(model_dir, world_size, *, enable_dbo, capture_sizes, groups):
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model_dir,
        dtype="float32",
        data_parallel_size=world_size,
        enable_expert_parallel=world_size > 1,
        enable_dbo=enable_dbo,
        dbo_decode_token_threshold=2,
        dbo_prefill_token_threshold=4,
        max_num_batched_tokens=4096,
        distributed_timeout_s=120,
        enforce_eager=capture_sizes is None,
        cudagraph_capture_sizes=capture_sizes,
    )
    return LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)


def _steps(engine, prompts, dp_rank, dp_size, max_tokens=8):
    """Logits of every computed row of the first NUM_STEPS steps, then greedy tokens to the end."""
    from launch.engine.request import Request, SamplingParams

    for index in range(dp_rank, len(prompts), dp_size):
        engine.add_request(
            Request(
                request_id=index,
                prompt_token_ids=list(prompts[index]),
                sampling_params=SamplingParams(max_tokens=max_tokens),
            )
        )
    logits, ubatched = [], []
    for _ in range(NUM_STEPS):
        scheduler_output = engine.scheduler.schedule()
        forward = engine.model_runner.run_forward(scheduler_output)
        ubatched.append(forward.is_ubatched)
        num_rows = forward.inputs.attn_metadata.num_actual_tokens
        with torch.inference_mode():
            rows = engine.model.compute_logits(forward.hidden_states[:num_rows])
        qsl = forward.inputs.attn_metadata.query_start_loc.tolist()
        sampled = {
            item.request.request_id: int(rows[qsl[i + 1] - 1].argmax())
            for i, item in enumerate(scheduler_output.scheduled)
            if qsl[i + 1] > qsl[i]
        }
        logits.append(rows.clone().numpy())
        engine.scheduler.update_from_output(scheduler_output, sampled)
    finished = engine.run_until_done()
    tokens = {r.request_id: r.output_token_ids for r in finished}
    return logits, tokens, ubatched


def _rank_fn(rank, world_size, model_dir, prompts, configs):
    from distributed import init_distributed

    groups = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=world_size > 1, timeout_s=120
    )
    results = {}
    for name, enable_dbo, capture_sizes in configs:
        engine = _engine(
            model_dir, world_size, enable_dbo=enable_dbo, capture_sizes=capture_sizes, groups=groups
        )
        assert (engine.graph_stats is None) == (capture_sizes is None)
        results[name] = _steps(engine, prompts, groups.dp_rank, groups.dp_size)
    return results


def _assert_graph_equals_eager(per_rank, graph_names, eager_name="eager"):
    for result in per_rank:
        ref_logits, ref_tokens, _ = result[eager_name]
        for name in graph_names:
            logits, tokens, _ = result[name]
            assert tokens == ref_tokens, name
            for got, want in zip(logits, ref_logits, strict=True):
                got, want = torch.from_numpy(got), torch.from_numpy(want)
                atol = 64 * torch.finfo(torch.float32).eps * float(want.abs().max())
                torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=name)


@pytest.mark.slow
def test_graph_mode_equals_eager_dp_ep_dbo(tiny_mixtral_dir, tiny_prompts, transformers_greedy):
    configs = [
        ("eager", True, None),
        ("graph_dbo", True, GRAPH_SIZES),
        ("graph", False, GRAPH_SIZES),
    ]
    per_rank = run_distributed(_rank_fn, 2, tiny_mixtral_dir, tiny_prompts, configs, timeout_s=900)
    _assert_graph_equals_eager(per_rank, ["graph_dbo", "graph"])
    for result in per_rank:
        assert all(result["graph_dbo"][2]) and not any(result["graph"][2])
        for index, tokens in result["graph_dbo"][1].items():
            assert tokens == transformers_greedy[index]


@pytest.mark.slow
def test_graph_mode_equals_eager_embedded_model():
    from launch.engine.embedded import synthetic_prompts
    from moe.model_loader import EMBEDDED_MODEL_CONFIG

    prompts = synthetic_prompts(seed=0, vocab_size=EMBEDDED_MODEL_CONFIG["vocab_size"])[:6]
    # 6 prompts of 16-48 tokens: the prefill (> 16 rows) runs eagerly, the decodes in bucket 8
    configs = [("eager", False, None), ("graph", False, (8, 16))]
    per_rank = run_distributed(_rank_fn, 1, None, prompts, configs, timeout_s=900)
    _assert_graph_equals_eager(per_rank, ["graph"])


def _norm_piece(device="cpu"):
    """A piece as graph mode cuts them: an FX graph of (residual add, RMSNorm) taking its weight
    as an input."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe.layers.norm import RMSNorm

    norm = RMSNorm(32, 1e-5, device=device)
    torch.nn.init.normal_(norm.weight)

    def piece(weight, h, mlp_out):
        return (torch.func.functional_call(norm, {"weight": weight}, (h + mlp_out,)),)

    example = [norm.weight.detach(), torch.randn(8, 32, device=device)]
    example.append(torch.randn(8, 32, device=device))
    with torch.inference_mode():
        return make_fx(piece)(*example), example


@pytest.mark.slow
def test_compiled_piece_is_reentrant_across_threads():
    """Two threads call one compiled graph at once (no baton): results equal the eager piece's."""
    from moe.compilation.backends import InductorGraph

    torch.manual_seed(0)
    piece, example = _norm_piece()
    weight = example[0]
    inputs = [[torch.randn(8, 32), torch.randn(8, 32)] for _ in range(2)]
    with torch.inference_mode():
        graph = InductorGraph(piece, example, cpp_wrapper=True)
        expected = [piece(weight, *x)[0] for x in inputs]
        errors = []

        def worker(i):
            with torch.inference_mode():
                for _ in range(500):
                    (out,) = graph(weight, *inputs[i])
                    if not torch.allclose(out, expected[i], rtol=0, atol=1e-6):
                        errors.append(i)
                        return

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_piece_equals_eager():
    from moe.compilation.backends import CUDAGraphPiece

    piece, (weight, x, y) = _norm_piece("cuda")
    with torch.inference_mode():
        graph = CUDAGraphPiece(piece, [weight, x, y], [True, False, False])
        (out,) = graph(weight, x * 2, y)
        torch.testing.assert_close(out, piece(weight, x * 2, y)[0], rtol=0, atol=1e-6)


def test_graph_cache_is_kept_per_cpu_capability(monkeypatch, tmp_path):
    """A graph compiled under one ATen dispatch level gave wrong values when loaded under another,
    so each CPU capability gets its own inductor cache directory, appended once."""
    import dataclasses

    from launch.engine import graph_mode
    from moe.platforms import CpuPlatform

    platform = CpuPlatform()
    capability = dataclasses.replace(platform.cpu_capability(), torch_capability="AVX2", isa="avx2")
    monkeypatch.setattr(platform, "cpu_capability", lambda: capability)
    monkeypatch.setattr(graph_mode, "current_platform", lambda: platform)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert graph_mode.graph_cache_dir() == str(tmp_path / "cpu-avx2-avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cpu-avx2-avx2"))
    assert graph_mode.graph_cache_dir() == str(tmp_path / "cpu-avx2-avx2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert graph_mode.graph_cache_dir() == str(tmp_path / "moe-dbo" / "inductor" / "cpu-avx2-avx2")
