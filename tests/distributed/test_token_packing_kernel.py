"""Our compiled ``pack_sent_rows`` (``moe/kernels/csrc/token_packing_cpu.cpp``) against the torch
ops of ``token_packing.pack_sent_rows`` (the kernels turned off), byte for byte, on each ISA's
build: back-to-back rows and padded blocks, every row dtype, tokens routed nowhere, ``-1`` slots;
that ``pack_sent_rows`` runs the kernel on host tensors and the torch ops where kernels are off;
and ``unpack_row_ranges``' kernel against its torch path."""

from __future__ import annotations

import pytest
import torch

from distributed.all2all import token_packing
from distributed.all2all.token_packing import (
    RowLayout,
    pack_rows,
    pack_sent_rows,
    token_rank_mask,
    unpack_row_ranges,
)
from tests.helpers.cpu_kernels import ISAS, kernel_module_for


def _inputs(num_tokens: int, num_topk: int, hidden_size: int, num_experts: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
    order = torch.argsort(torch.rand(num_tokens, num_experts, generator=g), dim=1)
    ids = order[:, :num_topk].contiguous()  # distinct experts per token
    ids[torch.rand(num_tokens, num_topk, generator=g) < 0.2] = -1  # unselected slots
    weights = torch.rand(num_tokens, num_topk, generator=g)
    return x, ids, weights


def _kernel_pack(module, x, ids, weights, mask, layout, num_local_experts, block, ep_size=2):
    return module.pack_sent_rows(
        x,
        ids,
        weights,
        mask,
        ep_size if mask is None else mask.shape[1],
        num_local_experts,
        layout.weights_offset,
        layout.hidden_offset,
        layout.row_bytes,
        0 if block is None else block,
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    ("num_tokens", "ep_size", "num_topk"), [(0, 2, 2), (1, 1, 1), (7, 2, 2), (33, 4, 3), (20, 2, 8)]
)
@pytest.mark.parametrize("spare_rows", [None, 0, 3])  # None: back to back; else padded blocks
@pytest.mark.parametrize("mask_given", [True, False])
def test_kernel_packs_the_reference_bytes(
    monkeypatch, isa, dtype, num_tokens, ep_size, num_topk, spare_rows, mask_given
):
    module = kernel_module_for(isa)
    num_local_experts = 4 if num_topk <= 4 else 8
    hidden_size = 5 if dtype != torch.float64 else 6  # odd widths: padding inside the row
    x, ids, weights = _inputs(
        num_tokens, num_topk, hidden_size, num_local_experts * ep_size, dtype, seed=num_tokens
    )
    layout = RowLayout(hidden_size=hidden_size, num_topk=num_topk, dtype=dtype)
    mask = token_rank_mask(ids, num_local_experts=num_local_experts, ep_size=ep_size)
    block = None if spare_rows is None else 1 + num_tokens + spare_rows
    given = mask if mask_given else None
    got = _kernel_pack(module, x, ids, weights, given, layout, num_local_experts, block, ep_size)
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")  # the torch ops
    want = pack_sent_rows(
        x,
        ids,
        weights,
        layout,
        num_local_experts=num_local_experts,
        ep_size=ep_size,
        is_token_in_rank=given,
        block=block,
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_refuses_a_block_without_room(isa):
    module = kernel_module_for(isa)
    x, ids, weights = _inputs(4, 2, 8, 4, torch.float32, seed=0)
    layout = RowLayout(hidden_size=8, num_topk=2, dtype=torch.float32)
    mask = token_rank_mask(ids, num_local_experts=2, ep_size=2)
    with pytest.raises(ValueError, match="block must hold a header row and every token"):
        _kernel_pack(module, x, ids, weights, mask, layout, 2, 4)
    with pytest.raises(ValueError, match="block must hold a header row and every token"):
        pack_sent_rows(x, ids, weights, layout, num_local_experts=2, ep_size=2, block=4)
    with pytest.raises(RuntimeError, match="topk_ids must be contiguous int64"):
        _kernel_pack(module, x, ids.int(), weights, mask, layout, 2, None)
    with pytest.raises(ValueError, match="topk_ids holds expert id 4, past the 4 experts"):
        _kernel_pack(module, x, torch.full_like(ids, 4), weights, None, layout, 2, None)


def test_pack_sent_rows_takes_the_kernel_on_host_tensors_and_the_reference_when_off(monkeypatch):
    x, ids, weights = _inputs(9, 2, 8, 8, torch.bfloat16, seed=3)
    layout = RowLayout(hidden_size=8, num_topk=2, dtype=torch.bfloat16)
    kw = {"num_local_experts": 4, "ep_size": 2, "block": 10}
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")
    want = pack_sent_rows(x, ids, weights, layout, **kw)
    monkeypatch.undo()
    calls = []
    kernel = token_packing._packing_kernel(x)
    if kernel is not None:  # the kernels built here: pack_sent_rows must call them
        monkeypatch.setattr(
            token_packing, "_packing_kernel", lambda t: lambda *a: calls.append(1) or kernel(*a)
        )
    got = pack_sent_rows(x, ids, weights, layout, **kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(calls) == (kernel is not None)
    monkeypatch.undo()
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")
    assert token_packing._packing_kernel(x) is None
    got = pack_sent_rows(x, ids, weights, layout, **kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "ranges", [[], [(0, 0)], [(0, 9)], [(1, 3), (5, 0), (6, 3)], [(4, 2), (0, 1)]]
)
def test_unpack_row_ranges_kernel_equals_the_torch_path(monkeypatch, dtype, ranges):
    x, ids, weights = _inputs(9, 3, 7, 8, dtype, seed=len(ranges))
    layout = RowLayout(hidden_size=7, num_topk=3, dtype=dtype)
    packed = pack_rows(x, ids, weights, layout)
    got = unpack_row_ranges(packed, layout, ranges)
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")
    want = unpack_row_ranges(packed, layout, ranges)
    rows = [i for first, n in ranges for i in range(first, first + n)]
    for g, w, source in zip(got, want, (ids, weights, x), strict=True):
        assert g.dtype == w.dtype and g.is_contiguous() and w.is_contiguous()
        assert torch.equal(g, w) and torch.equal(g, source[rows])


def test_unpack_row_ranges_refuses_rows_outside_the_buffer():
    layout = RowLayout(hidden_size=4, num_topk=2, dtype=torch.float32)
    packed = torch.zeros(5, layout.row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rows \[3, 6\) lie outside the 5 rows"):
        unpack_row_ranges(packed, layout, [(0, 1), (3, 3)])
    with pytest.raises(ValueError, match="packed rows must be"):
        unpack_row_ranges(packed[:, :8], layout, [(0, 1)])
