"""The engine with every op on its platform path (``--custom-ops all``, the CPU linear and expert
kernels) against every op on ``forward_native`` (``none``): float32 greedy tokens equal.

float32 is the dtype both paths compute alike (the linear layers run ``F.linear`` on both; the
experts' grouped GEMM and the batched attention round within ~1e-6 of the loops, far below the
tiny checkpoint's top-2 logit gaps). bfloat16 takes the prepacked oneDNN kernels, whose rounding
may flip a near-tie token of a random-weight model, so there only the paths and a full run are
checked (their agreement with forward_native is tested per op in ``tests/moe/test_linear.py``).
"""

from __future__ import annotations

import pytest
import torch

from launch.engine.request import Request, SamplingParams
from moe import set_custom_ops
from tests.helpers.capability import needs_onednn
from tests.helpers.single_rank import single_rank_engine


@pytest.fixture(autouse=True)
def _restore_custom_ops():
    yield
    set_custom_ops("all")


def _greedy(engine, prompts, max_tokens=8) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(
            Request(
                request_id=i,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=max_tokens),
            )
        )
    finished = engine.run_until_done()
    return [r.output_token_ids for r in sorted(finished, key=lambda r: r.request_id)]


def _paths(engine) -> set[str]:
    return {
        m.forward_path for m in engine.model_runner.model.modules() if hasattr(m, "forward_path")
    }


def test_float32_tokens_equal_with_custom_ops_all_and_none(tiny_mixtral_dir, tiny_prompts):
    tokens = {}
    for custom_ops in ("all", "none"):
        engine = single_rank_engine(tiny_mixtral_dir, dtype="float32", custom_ops=custom_ops)
        assert ("forward_cpu" in _paths(engine)) == (custom_ops == "all")
        tokens[custom_ops] = _greedy(engine, tiny_prompts)
    assert tokens["all"] == tokens["none"]
    assert all(1 <= len(t) <= 8 for t in tokens["all"])  # 8 new tokens or up to eos


@needs_onednn(torch.bfloat16)  # else the engine runs a bfloat16 request in float32
def test_bfloat16_engine_serves_from_packed_weights(tiny_mixtral_dir, tiny_prompts):
    engine = single_rank_engine(tiny_mixtral_dir, dtype="bfloat16")
    model = engine.model_runner.model
    experts = model.model.layers[0].block_sparse_moe.experts
    with torch.no_grad():  # the model's forward runs under no_grad; packs serve only there
        assert model.lm_head.forward_path == "forward_cpu"
        assert model.lm_head.packed_weight() is not None
        assert len(experts.packed_weights()) == 2 * experts.num_local_experts
    assert all(1 <= len(t) <= 8 for t in _greedy(engine, tiny_prompts))
