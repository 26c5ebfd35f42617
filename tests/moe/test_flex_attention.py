"""FLEX_ATTENTION (``moe.layers.flex_attention``) equals the per-request reference
(``forward_native``) in float64: mixed decode rows and prefill chunks, query tiles holding rows
of several requests and requests spanning several tiles, padding rows, requests cut across two
ubatches, empty ubatches, GQA groups 1-4. ``flex_attention`` runs eagerly here (the same block
mask and mask function the compiled kernel takes: torch's reference of it); one test compiles it
on the CPU for a fixed shape (fullgraph, as on a GPU) and compares. The backend's selection and
refusals (``moe.layers.attention_backend``) are tested here too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_mask, flex_attention

from launch.engine.arg_utils import EngineArgs
from moe.layers import attention_selector
from moe.layers import flex_attention as flex_module
from moe.layers.attention_backend import AttentionBackendEnum
from moe.layers.attention_metadata import CommonAttentionMetadata
from moe.layers.attention_selector import set_attention_backend
from moe.layers.mla import PagedMLACache
from moe.platforms import CpuPlatform, CudaPlatform, set_current_platform
from tests.helpers.host_reads import recording_host_reads
from tests.moe.test_batched_attention import (
    BLOCK_SIZE,
    MIXED,
    MLA_LAYOUT,
    assert_forward_cpu_equals_native,
    assert_request_cut_across_ubatches_equals_native,
    gqa_inputs,
    make_gqa,
    make_metadata,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# 40 decode rows (tiles of 16 rows from 16 requests), a 37-row prompt spanning three tiles after
# a cached context, and MIXED's requests
MANY = [(5 + i % 7, 1) for i in range(20)] + [(9, 37)] + MIXED[:6] + [(2, 1)] * 4


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    """Every FLEX_ATTENTION op runs ``flex_attention`` eagerly (compiling per shape on the CPU
    takes ~20 s; the conftest resets the backend after each test)."""
    monkeypatch.setattr(flex_module, "compiled_flex_attention", lambda: flex_attention)


def make_op(num_heads, num_kv_heads, backend, **cache):
    """``make_gqa``'s op (heads of 8, a prefilled cache) built with ``backend`` selected."""
    set_attention_backend(backend)
    return make_gqa(num_heads, num_kv_heads, **cache)


def native_and_flex(num_heads, num_kv_heads, **cache):
    native = make_op(num_heads, num_kv_heads, AttentionBackendEnum.TORCH_SDPA, **cache)
    flex = make_op(num_heads, num_kv_heads, AttentionBackendEnum.FLEX_ATTENTION, **cache)
    return native, flex


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("requests", [MIXED, MANY], ids=["mixed", "many"])
@pytest.mark.parametrize("num_padding", [0, 3])
def test_flex_equals_native(group, requests, num_padding):
    native, flex = native_and_flex(2 * group, 2, num_blocks=512)
    md = make_metadata(requests, num_padding=num_padding, num_blocks=512, max_blocks=12)
    assert_forward_cpu_equals_native(native, flex, md)


def test_flex_with_16_token_blocks():
    """The GPU's block size: cache blocks of 16 tokens, so one tile's rows share few blocks."""
    native, flex = native_and_flex(8, 2, block_size=16, num_blocks=64)
    md = make_metadata(
        [(0, 40), (17, 1), (31, 2), (60, 5), (3, 20)], block_size=16, num_blocks=64, max_blocks=5
    )
    q, k, v = gqa_inputs(native, md.num_tokens)
    torch.testing.assert_close(
        flex.forward_cpu(q, k, v, md), native.forward_native(q, k, v, md), rtol=1e-12, atol=1e-12
    )


def test_flex_request_cut_across_ubatches():
    assert_request_cut_across_ubatches_equals_native(*native_and_flex(8, 4))


def test_flex_empty_ubatch_calls_nothing(monkeypatch):
    monkeypatch.setattr(flex_module, "compiled_flex_attention", lambda: pytest.fail("called"))
    op = make_op(4, 2, AttentionBackendEnum.FLEX_ATTENTION)
    md = make_metadata([], num_padding=2)
    q, k, v = gqa_inputs(op, 2)
    out = op.forward_cpu(q, k, v, md)
    assert out.shape == (2, 4 * 8) and not out.any()


def test_tile_block_lists_hand_worked():
    """Block size 4, tiles of 16 rows. Request 0: one row at position 9 (logical blocks 0-2:
    7, 3, 5); request 1: 20 rows at positions 0-19 (blocks 10-14). Tile 0 holds request 0's row
    and request 1's rows at positions 0-14 (blocks 10-13); tile 1 request 1's rows at positions
    15-19 (blocks 10-14)."""
    md = make_metadata([(9, 1), (0, 20)])
    table = torch.tensor([[7, 3, 5, 0, 0], [10, 11, 12, 13, 14]], dtype=torch.int32)
    md = dataclasses.replace(md, block_table=table)
    mask = flex_module.flex_block_mask(md, BLOCK_SIZE, 16, torch.device("cpu"))
    num, idx = mask.kv_num_blocks[0, 0].tolist(), mask.kv_indices[0, 0].tolist()
    assert num == [7, 5]
    assert idx[0][:7] == [7, 3, 5, 10, 11, 12, 13] and idx[1][:5] == [10, 11, 12, 13, 14]


def _tile_blocks(num_blocks: Tensor, indices: Tensor, num_tiles: int, cache_blocks: int):
    """[tiles, cache blocks] bool: the blocks each tile lists (one of the block mask's lists)."""
    listed = torch.zeros(num_tiles, cache_blocks, dtype=torch.bool)
    for t, (n, idx) in enumerate(zip(num_blocks[0, 0], indices[0, 0], strict=True)):
        listed[t, idx[:n].long()] = True
    return listed


@pytest.mark.parametrize(
    "requests, block_size",
    [
        (MIXED, 4),
        (MANY, 4),
        ([(0, 40), (17, 1), (31, 2), (60, 5), (3, 20)], 16),
        ([(8, 32), (0, 16), (5, 50)], 4),
    ],
    ids=["mixed", "many", "blocks16", "prefills"],
)
def test_tiles_visit_every_block_the_mask_keeps(requests, block_size):
    """The compiled kernel reads only the listed blocks and skips the mask function in the full
    ones (the eager reference applies it everywhere): every (row, slot) the mask keeps lies in a
    block its tile lists, a full block is kept whole by every row of its tile, no block is both,
    and each row keeps exactly its causal context."""
    md = make_metadata(requests, block_size=block_size, num_blocks=512, max_blocks=16)
    mask = flex_module.flex_block_mask(md, block_size, 512, torch.device("cpu"))
    rows, slots = md.num_actual_tokens, 512 * block_size
    kept = create_mask(mask.mask_mod, None, None, rows, slots, device="cpu")[0, 0]
    num_tiles = -(-rows // 16)
    partial = _tile_blocks(mask.kv_num_blocks, mask.kv_indices, num_tiles, 512)
    full = _tile_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, num_tiles, 512)
    assert not (partial & full).any()
    listed = (partial | full)[torch.arange(rows) // 16].repeat_interleave(block_size, dim=1)
    assert not (kept & ~listed).any()
    full_slots = full[torch.arange(rows) // 16].repeat_interleave(block_size, dim=1)
    assert (kept | ~full_slots).all()  # a full block: every row of the tile keeps all of it
    positions = md.seq_lens - (md.query_start_loc[1:] - md.query_start_loc[:-1])
    row_counts = kept.sum(1).tolist()
    expected = [
        p + i + 1 for p, (_, q) in zip(positions.tolist(), requests, strict=True) for i in range(q)
    ]
    assert row_counts == expected
    if block_size == 4 and requests[0] == (8, 32):  # a prefill of whole tiles has full blocks
        assert int(mask.full_kv_num_blocks.sum()) > 0


def test_full_blocks_hand_worked():
    """Block size 4, one request of 32 rows at positions 8-39 (logical block i in cache block
    20 + i). Tile 0 (positions 8-23) keeps blocks 0-1 whole (positions 0-7 precede its first
    row) and visits 2-5 partly; tile 1 (positions 24-39) keeps 0-5 whole and visits 6-9."""
    md = make_metadata([(8, 32)], max_blocks=10)
    md = dataclasses.replace(md, block_table=torch.arange(20, 30, dtype=torch.int32)[None])
    mask = flex_module.flex_block_mask(md, BLOCK_SIZE, 32, torch.device("cpu"))
    full_num, full_idx = mask.full_kv_num_blocks[0, 0].tolist(), mask.full_kv_indices[0, 0]
    num, idx = mask.kv_num_blocks[0, 0].tolist(), mask.kv_indices[0, 0]
    assert full_num == [2, 6] and num == [4, 4]
    assert full_idx[0, :2].tolist() == [20, 21] and full_idx[1, :6].tolist() == list(range(20, 26))
    assert idx[0, :4].tolist() == [22, 23, 24, 25] and idx[1, :4].tolist() == [26, 27, 28, 29]


def test_block_mask_built_once_per_ubatch_and_shared_by_layers(monkeypatch):
    calls = []
    real = flex_module._tile_kv_blocks
    monkeypatch.setattr(flex_module, "_tile_kv_blocks", lambda *a: calls.append(1) or real(*a))
    layers = [make_op(8, 2, AttentionBackendEnum.FLEX_ATTENTION) for _ in range(3)]
    md = make_metadata(MIXED, num_padding=2)
    q, k, v = gqa_inputs(layers[0], md.num_tokens)
    outs = [layer.forward_cpu(q, k, v, md) for layer in layers]
    assert len(calls) == 1 and all(torch.equal(o, outs[0]) for o in outs)


def test_a_block_in_two_requests_is_refused():
    op = make_op(4, 2, AttentionBackendEnum.FLEX_ATTENTION)
    md = make_metadata([(5, 1), (6, 1)])
    table = md.block_table.clone()
    table[1, 1] = table[0, 0]
    md = dataclasses.replace(md, block_table=table)
    q, k, v = gqa_inputs(op, md.num_tokens)
    with pytest.raises(ValueError, match="each KV cache block in one request"):
        op.forward_cpu(q, k, v, md)


def test_query_and_cache_dtypes_must_agree():
    op = make_op(4, 2, AttentionBackendEnum.FLEX_ATTENTION)
    md = make_metadata([(5, 1)])
    q = torch.zeros(1, 4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="query dtype torch.float32 must equal"):
        flex_module.flex_paged_attention(q, op.kv_cache, md, scale=1.0)


# fixed shapes for the compiled test: 16-token blocks, a cache of 4 blocks
COMPILED_CASES = {
    # request 0 one row over 3 blocks, request 1 16 rows in the fourth: tile 0 visits every block
    "mixed_tile": dict(
        query_start_loc=[0, 1, 17], seq_lens=[41, 16], block_table=[[2, 0, 3], [1, 0, 0]]
    ),
    # one request of 32 rows after a 32-token context: tile 0 keeps 2 blocks whole (full blocks,
    # no mask function), tile 1 keeps 3
    "full_blocks": dict(query_start_loc=[0, 32], seq_lens=[64], block_table=[[3, 1, 0, 2]]),
}


@pytest.mark.parametrize("case", sorted(COMPILED_CASES))
def test_compiled_flex_equals_eager_on_cpu(case, monkeypatch):
    """flex_attention compiled whole (fullgraph: our mask function and block mask trace without
    a break, as on a GPU) equals its eager reference, which applies the mask function
    everywhere: so the compiled kernel's block lists, full blocks included, are right. Inductor's
    CPU template compiles static shapes only and wants each list as wide as the cache (4 blocks
    here: the lists are padded to it; a GPU's template takes them as built)."""
    tile_lists = flex_module._tile_lists

    def as_wide_as_the_cache(*args):
        num, indices = tile_lists(*args)
        return num, torch.nn.functional.pad(indices, (0, 4 - indices.shape[1]))

    monkeypatch.setattr(flex_module, "_tile_lists", as_wide_as_the_cache)
    op = make_op(8, 2, AttentionBackendEnum.FLEX_ATTENTION, block_size=16, num_blocks=4)
    op.kv_cache = op.kv_cache.float()
    spec = {k: torch.tensor(v, dtype=torch.int32) for k, v in COMPILED_CASES[case].items()}
    num_rows = int(spec["query_start_loc"][-1])
    md = CommonAttentionMetadata(
        **spec,
        slot_mapping=torch.full((num_rows,), -1),  # nothing written: the cache is random already
        num_reqs=len(spec["seq_lens"]),
        num_actual_tokens=num_rows,
        num_tokens=num_rows,
        max_query_len=int((spec["query_start_loc"][1:] - spec["query_start_loc"][:-1]).max()),
        max_seq_len=int(spec["seq_lens"].max()),
    )
    if case == "full_blocks":
        mask = flex_module.flex_block_mask(md, 16, 4, torch.device("cpu"))
        assert mask.full_kv_num_blocks[0, 0].tolist() == [2, 3]
    query = torch.randn(md.num_tokens, 8, 8, generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    got = flex_module.flex_paged_attention(query, op.kv_cache, md, scale=0.35, flex=compiled)
    eager = flex_module.flex_paged_attention(
        query, op.kv_cache, md, scale=0.35, flex=flex_attention
    )
    torch.testing.assert_close(got, eager, rtol=2e-6, atol=2e-6)


def test_torch_sdpa_backend_never_calls_our_kernel(monkeypatch):
    from moe.layers import batched_attention

    def no_kernel(*args):
        pytest.fail("TORCH_SDPA called our CPU kernel")

    monkeypatch.setattr(batched_attention, "paged_attention_kernel", lambda q, c: no_kernel)
    native = make_op(8, 2, AttentionBackendEnum.TORCH_SDPA)
    sdpa = make_op(8, 2, AttentionBackendEnum.TORCH_SDPA)
    assert sdpa.kernel_cut == batched_attention.SDPA_EVERYWHERE
    md = make_metadata(MIXED, num_padding=1)
    q, k, v = gqa_inputs(native, md.num_tokens)
    torch.testing.assert_close(
        sdpa.forward_cpu(q, k, v, md), native.forward_native(q, k, v, md), rtol=1e-12, atol=1e-12
    )


def test_mla_refuses_flex_and_keeps_sdpa_chunks_under_torch_sdpa():
    set_attention_backend(AttentionBackendEnum.FLEX_ATTENTION)
    with pytest.raises(ValueError, match="FLEX_ATTENTION attends GQA layers only"):
        PagedMLACache(MLA_LAYOUT)
    set_attention_backend(AttentionBackendEnum.TORCH_SDPA)
    assert PagedMLACache(MLA_LAYOUT).use_kernel is False
    set_attention_backend(AttentionBackendEnum.CPU_ATTN)
    assert PagedMLACache(MLA_LAYOUT).use_kernel is True


@pytest.fixture
def platform_reset():
    yield
    set_current_platform(None)


def test_each_platform_names_its_default_and_refuses_the_others(platform_reset):
    set_current_platform(CpuPlatform())
    assert EngineArgs(dtype="float32").attention_backend == "CPU_ATTN"
    assert attention_selector.selected_attention_backend() is AttentionBackendEnum.CPU_ATTN
    with pytest.raises(ValueError, match="FLEX_ATTENTION does not run on this platform; choose "):
        EngineArgs(dtype="float32", attention_backend="FLEX_ATTENTION")
    with pytest.raises(ValueError, match=r"'flash' is not one of \['CPU_ATTN'"):
        EngineArgs(dtype="float32", attention_backend="flash")
    set_current_platform(CudaPlatform())
    assert EngineArgs(dtype="float32").attention_backend == "TORCH_SDPA"
    assert EngineArgs(attention_backend="FLEX_ATTENTION").attention_backend == "FLEX_ATTENTION"
    with pytest.raises(ValueError, match="needs --block-size a multiple of 16, got 8"):
        EngineArgs(attention_backend="FLEX_ATTENTION", block_size=8)
    with pytest.raises(ValueError, match="CPU_ATTN does not run on this platform"):
        EngineArgs(attention_backend="CPU_ATTN")


def test_our_side_reads_the_host_only_while_building_the_block_mask():
    """On CUDA tensors every host read is a device sync: the first call on a (u)batch reads only
    where its block mask is built from the host metadata, a second call nothing. ``flex`` is a
    stand-in here (torch's eager reference traces with ``torch.compile``, which the recorder's
    dispatch mode stops; the kernel a GPU compiles reads nothing)."""
    op = make_op(8, 2, AttentionBackendEnum.FLEX_ATTENTION)
    md = make_metadata(MIXED, num_padding=2)
    query = torch.randn(md.num_tokens, 8, 8, dtype=torch.float64)

    def stand_in(q, k, v, *, block_mask, scale, enable_gqa):
        return q * scale

    for expect_reads in (True, False):
        with recording_host_reads() as reads:
            flex_module.flex_paged_attention(query, op.kv_cache, md, scale=0.5, flex=stand_in)
        assert all("layers/flex_attention.py" in r for r in reads), reads
        assert bool(reads) is expect_reads, reads


def test_changing_shapes_compile_a_few_graphs_not_one_per_step():
    """What the engine's compiled flex_attention recompiles for is decided by Dynamo's guards on
    our block mask and mask function, the same whatever the backend (a counting one here, inductor
    on a GPU): 30 steps of random decode / prefill mixes (40-row prefills filling whole tiles, so
    with full blocks, and without) compile a handful of graphs (static, then dynamic, then
    one-tile and one-row specialisations), never one per step."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    flex = torch.compile(flex_attention, fullgraph=True, backend=counting_backend)
    kv_cache = torch.randn(2, 256, 16, 2, 8, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    # past Dynamo's recompile limit a function runs uncompiled and uncounted: lift the limit
    with torch._dynamo.config.patch(recompile_limit=100):
        for _ in range(30):
            num_reqs = int(torch.randint(1, 10, (1,), generator=gen))
            cached = torch.randint(0, 100, (num_reqs,), generator=gen).tolist()
            choice = torch.randint(0, 6, (num_reqs,), generator=gen)
            rows = torch.tensor([1, 1, 1, 5, 17, 40])[choice]
            requests = list(zip(cached, rows.tolist(), strict=True))
            md, _ = CommonAttentionMetadata.for_requests(requests, 16)
            query = torch.randn(md.num_tokens, 4, 8, generator=gen)
            flex_module.flex_paged_attention(query, kv_cache, md, scale=0.3, flex=flex)
    # a size of 1 (one tile, one request, one row) may specialise once more on another torch
    assert 1 <= len(graphs) <= 8, f"{len(graphs)} graphs compiled over 30 steps"
