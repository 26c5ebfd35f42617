"""No host read inside the forward on the CUDA paths (``forward_cuda`` / ``forward_native`` ops,
forced on CPU tensors: the code is pure torch, so what it reads here it would read on a GPU).

The MoE layer (router + experts + shared expert, no EP) reads nothing. A whole model reads only
while its first layer builds the (u)batch's attention plan from the metadata (padding plan, KV
write slots: host values the model runner's metadata already holds on the CPU), and nothing in a
forward that reuses it: no layer reads anything. A whole engine step with two EP ranks under DBO
reads, per module, only its results (once), the DP vote, the host metadata, and inside the expert
all-to-all only where a backend needs counts on the host (``all_to_all``'s uneven exchange).
"""

from __future__ import annotations

import pytest
import torch

from distributed import NoEPPrepareAndFinalize
from moe import build_model, load_checkpoint, load_config, set_custom_ops
from moe.fused_moe import FusedMoE, RoutingConfig
from moe.fused_moe.grouped_experts import grouped_mm_unavailable
from moe.platforms import CudaPlatform, set_current_platform
from tests.conftest import TINY_CONFIGS
from tests.helpers.attention_metadata import BLOCK_SIZE, make_paged_metadata
from tests.helpers.distributed import run_distributed
from tests.helpers.engine import dbo_test_engine_args
from tests.helpers.host_reads import reads_per_file, recording_host_reads

# where the per-(u)batch attention plan is built from the metadata (once per (u)batch)
PLAN_BUILDERS = ("layers/batched_attention.py", "layers/attention.py")


@pytest.fixture(autouse=True)
def _restore_global_state():
    yield
    set_custom_ops("all")
    set_current_platform(None)


def test_the_recorder_sees_each_kind_of_read():
    t = torch.tensor([0.0, 2.0, -1.0])
    saved = dict(torch.Tensor.__dict__)
    with recording_host_reads() as reads:
        t[1].item(), t.tolist(), bool(t[1]), int(t[1]), t.cpu(), t.nonzero()  # noqa: B018
        t[t > 0], torch.unique(t), torch.bincount(t.long().clamp(min=0))  # noqa: B018
        t[torch.arange(2)], t.sum() * 2, torch.where(t > 0, t, 0)  # noqa: B018  (no read)
    kinds = [r.split(" at ")[0] for r in reads]
    for kind in ("Tensor.item", "Tensor.tolist", "Tensor.__bool__", "Tensor.__int__"):
        assert kind in kinds
    for kind in ("Tensor.cpu", "aten.nonzero", "aten.index", "aten._unique2", "aten.bincount"):
        assert kind in kinds
    assert all(r.split(" at ")[1].startswith("moe/test_host_reads.py:") for r in reads), reads
    assert dict(torch.Tensor.__dict__) == saved  # the methods are restored


def _moe_layer(dtype, routing: RoutingConfig) -> FusedMoE:
    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(
        hidden_size=32,
        intermediate_size=16,
        num_experts=8,
        routing=routing,
        prepare_finalize=NoEPPrepareAndFinalize(num_experts=8),
        shared_intermediate_size=24,
        has_shared_expert_gate=True,
        dtype=dtype,
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    layer.experts.process_weights_after_loading()
    return layer


ROUTINGS = {
    "softmax_topk": RoutingConfig(num_experts=8, top_k=2),
    "noaux_tc_groups": RoutingConfig(
        num_experts=8,
        top_k=3,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        has_score_correction_bias=True,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_moe_layer_reads_nothing_on_the_cuda_path(dtype, routing):
    set_current_platform(CudaPlatform())
    layer = _moe_layer(dtype, ROUTINGS[routing])
    assert layer.experts.forward_path == "forward_cuda"
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        layer(x[:5])  # warm-up: torch._grouped_mm's capability probe reads, once per process
    with torch.no_grad(), recording_host_reads() as reads:
        out = layer(x)
    assert reads == []
    with torch.no_grad():
        routing_result = layer.gate(x)
        native = layer.experts.forward_native(
            x, routing_result.topk_ids, routing_result.topk_weights
        )
        native = native + layer._shared_experts(x)
    # same routing and shared expert; the experts' own comparison is test_grouped_experts'
    rel = {torch.float64: 1e-12, torch.float32: 2**-20, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(out, native, rtol=0, atol=rel * float(native.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_model_forward_reads_only_the_per_batch_metadata(tiny_arch_dirs, model_type, dtype):
    """A prefill of two prompts, then a decode step: the first forward on each metadata object
    reads only where the attention plan is built; a second forward on it reads nothing."""
    set_current_platform(CudaPlatform())
    grouped_mm_unavailable(torch.device("cpu"), dtype)  # the once-per-process probe reads
    path = tiny_arch_dirs[model_type]
    model = build_model(load_config(path), dtype=dtype)
    load_checkpoint(model, path)
    model.allocate_kv_caches(16, BLOCK_SIZE)
    assert {m.forward_path for m in model.modules() if hasattr(m, "forward_path")} <= {
        "forward_native",
        "forward_cuda",
    }
    block_tables = [[5, 2, 9], [11, 0]]
    steps = [
        (torch.arange(3, 13), torch.tensor([*range(7), *range(3)]), ([7, 3], [7, 3])),
        (torch.tensor([20, 21]), torch.tensor([7, 3]), ([1, 1], [8, 4])),
    ]
    for input_ids, positions, (query_lens, seq_lens) in steps:
        metadata = make_paged_metadata(query_lens, seq_lens, block_tables)
        with torch.no_grad(), recording_host_reads() as first:
            expected = model(input_ids, positions, metadata)
        assert all(any(b in r for b in PLAN_BUILDERS) for r in first), first
        with torch.no_grad(), recording_host_reads() as again:
            out = model(input_ids, positions, metadata)
        assert again == []
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


ENGINE_BACKENDS = ("allgather_reducescatter", "all_to_all", "deepep_low_latency")
# what a step may read outside the model's layers and the all-to-all, once each
STEP_READS = {
    "engine/sampler.py": 1,  # the step's results: tokens, NaN flags, logprobs in ONE copy
    "dbo/dp_coordination.py": 1,  # the DP vote's table (a collective deciding the step's shape)
    "dbo/ubatch_slicing.py": 1,  # the cut points, from the host's query_start_loc (no sync)
}
# where each backend may read (an uneven all_to_all needs its split sizes on the host)
ALL2ALL_READS = {
    "allgather_reducescatter": set(),  # under DBO the agreed counts spare its exchange
    # the in-band row counts of its padded dispatch (or the count exchange) and the rows they size
    "all_to_all": {"all2all/all_to_all.py", "all2all/token_packing.py"},
    # fixed blocks both ways, rows placed by device-computed indices, as DeepEP's kernels (our
    # emulation reads only under an emulated link, for its byte bill, or MOE_DBO_DEBUG_CHECKS)
    "deepep_low_latency": set(),
}


def _engine_step_reads(rank, world_size, model_dir, prompts):
    """Per backend: a decode step of this rank's share of ``prompts`` (greedy, seeded top-p and
    logprobs requests) under DBO on the CUDA op paths, recorded; (reads, ubatches, step output).
    No step synchronises the device (static thresholds: no adaptive policy to time)."""
    from launch.engine.llm_engine import LLMEngine
    from launch.engine.request import Request, SamplingParams
    from tests.helpers.gpu import placed_groups
    from tests.launch.test_cuda_paths_on_cpu import _cuda_ops_on_cpu

    _, groups = placed_groups(_cuda_ops_on_cpu(), rank, world_size, timeout_s=60)
    results = {}
    for backend in ENGINE_BACKENDS:
        args = dbo_test_engine_args(
            model_dir, world_size, True, all2all_backend=backend, num_gpu_blocks_override=64
        )
        engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
        syncs = []  # the step clock's device syncs: none without an "auto" threshold
        engine.model_runner.platform.synchronize = syncs.append
        for i in range(rank, len(prompts), world_size):
            params = SamplingParams(
                max_tokens=4,
                temperature=0.0 if i % 2 else 0.8,
                top_p=0.9 if i % 4 == 0 else 1.0,
                seed=i,
                logprobs=2 if i % 3 == 0 else None,
            )
            engine.add_request(
                Request(request_id=i, prompt_token_ids=prompts[i], sampling_params=params)
            )
        for _ in range(3):  # prefill, a warm-up decode, the recorded decode
            scheduler_output = engine.scheduler.schedule()
            with recording_host_reads() as reads:
                output = engine.model_runner.execute_model(scheduler_output)
            engine.scheduler.update_from_output(
                scheduler_output, output.sampled_token_ids, output.failed_request_ids
            )
        assert syncs == [], syncs
        results[backend] = (
            list(reads),
            output.num_ubatches,
            sorted(output.sampled_token_ids),
            sorted(output.sampled_logprobs),
        )
    return results


@pytest.mark.slow
def test_engine_step_with_ep_and_dbo_reads_only_its_results(tiny_mixtral_dir, tiny_prompts):
    per_rank = run_distributed(_engine_step_reads, 2, tiny_mixtral_dir, tiny_prompts, timeout_s=280)
    for rank, results in enumerate(per_rank):
        own = list(range(rank, len(tiny_prompts), 2))
        for backend, (reads, num_ubatches, sampled, with_logprobs) in results.items():
            label = f"rank {rank} {backend}: {reads}"
            assert num_ubatches == 2, label
            assert sampled == own and with_logprobs == [i for i in own if i % 3 == 0], label
            per_file = reads_per_file(reads)
            # Owned by the attention change (moe/layers/attention.py's KV write slots read
            # bool(valid.all()) once per ubatch: a __bool__ and its aten.is_nonzero, 2 ubatches);
            # 0 once that change lands.
            assert per_file.pop("layers/attention.py", 0) == 4, label
            # the per-(u)batch attention plan from the host metadata (no sync: CPU by design)
            for plan in ("layers/batched_attention.py", "layers/attention_metadata.py"):
                per_file.pop(plan, None)
            all2all = {f for f in per_file if f.startswith("all2all/")}
            assert all2all == ALL2ALL_READS[backend] or (
                backend == "all_to_all" and all2all and all2all <= ALL2ALL_READS[backend]
            ), label
            for f in all2all:
                del per_file[f]
            assert per_file == STEP_READS, label
