"""Our compiled ``rotary_embedding`` (``moe/kernels/csrc/rotary_cpu.cpp``) against
``RotaryEmbedding.forward_table`` and ``forward_native``, bit for bit, on each ISA's build: every
dtype, both layouts, query and key as strided views of one projection (as attention passes them),
positions at the table's ends; positions past the table; and that ``forward_cpu`` runs it."""

from __future__ import annotations

import pytest
import torch

from moe.layers import rotary
from moe.layers.rotary import RotaryEmbedding
from tests.helpers.cpu_kernels import ISAS, kernel_module_for

MAX_POSITIONS = 64


def _qk(num_tokens: int, dtype: torch.dtype, *, heads=(4, 2), head_dim=16, seed=0):
    """q [n, 4, d] and k [n, 2, d]: views of one [n, (4 + 2 + 2) * d] projection, as attention's
    merged q/k/v GEMM makes them (rows strided by the whole projection)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads[0] + 2 * heads[1]) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads[0] * head_dim, heads[1] * head_dim, heads[1] * head_dim], dim=-1)
    return q.view(num_tokens, heads[0], head_dim), k.view(num_tokens, heads[1], head_dim)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("is_neox_style", [True, False])
def test_kernel_equals_the_table_path_bit_for_bit(isa, dtype, is_neox_style):
    module = kernel_module_for(isa)
    rope = RotaryEmbedding(
        16, 1e4, is_neox_style=is_neox_style, max_position_embeddings=MAX_POSITIONS
    )
    positions = torch.tensor([0, 7, MAX_POSITIONS - 1, 31, 2, 2, 50])
    q, k = _qk(positions.shape[0], dtype, seed=int(is_neox_style))
    table = rope._rotation_table(q.device, dtype)
    in_range, got_q, got_k = module.rotary_embedding(positions, q, k, table, is_neox_style)
    want_q, want_k = rope.forward_table(positions, q, k)
    assert in_range
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if dtype in (torch.float32, torch.float64):  # the table path equals the reference there too
        ref_q, ref_k = rope.forward_native(positions, q, k)
        assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    empty = module.rotary_embedding(positions[:0], q[:0], k[:0], table, is_neox_style)
    assert empty[0] and empty[1].shape == (0, 4, 16) and empty[2].shape == (0, 2, 16)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_reports_positions_past_the_table_and_refuses_bad_tensors(isa):
    module = kernel_module_for(isa)
    rope = RotaryEmbedding(16, 1e4, max_position_embeddings=MAX_POSITIONS)
    q, k = _qk(3, torch.float32)
    table = rope._rotation_table(q.device, torch.float32)
    for positions in ([0, MAX_POSITIONS, 1], [0, -1, 1]):
        in_range, _, _ = module.rotary_embedding(torch.tensor(positions), q, k, table, True)
        assert not in_range
    with pytest.raises(RuntimeError, match="in the table's dtype"):
        module.rotary_embedding(torch.tensor([0, 1, 2]), q.double(), k, table, True)
    with pytest.raises(RuntimeError, match="positions must be contiguous int64"):
        module.rotary_embedding(torch.tensor([0, 1]), q, k, table, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_cpu_runs_the_kernel_and_computes_past_the_table(monkeypatch, dtype):
    rope = RotaryEmbedding(16, 1e4, max_position_embeddings=MAX_POSITIONS)
    q, k = _qk(4, dtype)
    kernel = rotary._rotary_kernel(q, k)
    calls = []
    if kernel is not None:  # the kernels built here: forward_cpu must call them
        monkeypatch.setattr(
            rotary, "_rotary_kernel", lambda *t: lambda *a: calls.append(1) or kernel(*a)
        )
    positions = torch.tensor([3, 0, 63, 9])
    for a, b in zip(
        rope.forward_cpu(positions, q, k), rope.forward_table(positions, q, k), strict=True
    ):
        assert torch.equal(a, b)
    assert len(calls) == (kernel is not None)
    beyond = torch.tensor([3, 100, 63, 9])  # past the table: cos/sin computed, as forward_native
    for a, b in zip(rope.forward_cpu(beyond, q, k), rope.forward_native(beyond, q, k), strict=True):
        assert torch.equal(a, b)
