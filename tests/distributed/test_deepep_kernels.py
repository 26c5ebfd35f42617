"""DeepEP's own kernels behind our adapters: the same dispatch / combine round trip as the
emulation. Needs ``deep_ep``, two CUDA devices and NCCL; skipped elsewhere (it has not run yet)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("deep_ep") is None or torch.cuda.device_count() < 2,
        reason="needs deep_ep and two CUDA devices",
    ),
]

HIDDEN = 7168  # a hidden size DeepEP's low-latency kernels are compiled for (DeepSeek-V3)


def _rank(rank: int, world_size: int) -> dict:
    from distributed import FusedMoEActivationFormat, init_distributed, make_prepare_finalize

    torch.cuda.set_device(rank)
    groups = init_distributed(data_parallel_size=world_size, enable_expert_parallel=True)
    out = {}
    for name in ("deepep_high_throughput", "deepep_low_latency"):
        backend = make_prepare_finalize(
            name,
            ep_group=groups.ep_group,
            ep_rank=groups.ep_rank,
            ep_size=world_size,
            num_experts=8,
            timeout=groups.timeout,
            hidden_size=HIDDEN,
            num_max_dispatch_tokens_per_rank=64,
        )
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(32, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
        ids = torch.rand(32, 8, generator=gen).argsort(dim=1)[:, :2].cuda()
        w = torch.rand(32, 2, generator=gen).cuda()
        result = backend.dispatch(x, ids, w, async_op=True).wait()
        batched = backend.activation_format is FusedMoEActivationFormat.BatchedExperts
        if batched:  # identity experts, weights applied by combine
            expert_output = result.hidden_states
        else:  # identity experts applying the local weights
            expert_output = (result.hidden_states.float() * result.topk_weights.sum(1, True)).to(
                x.dtype
            )
        y = backend.combine(expert_output, result.metadata, async_op=True).wait()
        torch.cuda.synchronize()
        reference = x.float() * w.sum(1, keepdim=True)
        out[name] = (backend.implementation, (y.float() - reference).abs().max().item())
    return out


def test_deepep_kernels_round_trip():
    for per_rank in run_distributed(_rank, 2, timeout_s=300):
        for implementation, max_diff in per_rank.values():
            assert implementation == "deep_ep kernels"
            assert max_diff < 0.1  # bf16 values of magnitude ~4, summed over two experts
