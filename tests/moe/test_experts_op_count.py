"""What one MoE block dispatches on the CUDA path (``CudaPlatform``'s ops on CPU tensors): an
OLMoE-shaped block (hidden 256, 32 experts, top-4, no expert parallelism) issues a fixed number of
ATen ops (views not counted) and Triton launches, the same at a decode batch of 8 tokens and at
256, and reads nothing to the host: router 6 ops, then the experts with ``torch._grouped_mm``
(the default) 18, with our Triton kernels 21 and 2 launches.
"""

from __future__ import annotations

import pytest
import torch

from distributed import NoEPPrepareAndFinalize
from moe.fused_moe import FusedMoE, RoutingConfig
from moe.fused_moe.experts import CUDA_EXPERTS_ENV
from moe.platforms import CudaPlatform, set_current_platform
from tests.helpers.host_reads import recording_host_reads
from tests.helpers.op_count import count_ops

# backend -> (ATen ops of the whole block, Triton launches)
BUDGETS = {"grouped_mm": (24, 0), "triton": (27, 2)}


@pytest.fixture(autouse=True)
def _restore_platform():
    yield
    set_current_platform(None)


def _olmoe_block(dtype) -> FusedMoE:
    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(
        hidden_size=256,
        intermediate_size=128,
        num_experts=32,
        routing=RoutingConfig(num_experts=32, top_k=4),
        prepare_finalize=NoEPPrepareAndFinalize(num_experts=32),
        dtype=dtype,
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    layer.experts.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("backend", list(BUDGETS))
def test_moe_block_issues_a_fixed_number_of_ops_at_any_batch(monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setenv(CUDA_EXPERTS_ENV, backend)
    set_current_platform(CudaPlatform())
    layer = _olmoe_block(torch.bfloat16)
    counts = {}
    for num_tokens in (8, 256):
        x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
        with torch.no_grad():
            counts[num_tokens] = count_ops(lambda x=x: layer(x))
            with recording_host_reads() as reads:
                count_ops(lambda x=x: layer(x))  # launches counted, not run
        assert reads == []
    assert counts[8] == counts[256]  # the same ops in the same order
    max_ops, num_launches = BUDGETS[backend]
    assert counts[8].num_aten_ops <= max_ops, counts[8].aten_ops
    assert counts[8].triton_launches == num_launches
