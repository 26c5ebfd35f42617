"""Batched paged attention (forward_cpu) equals the per-request reference (forward_native), float64,
on its plain torch path (the padded SDPA chunks, the compiled kernel off) and, where a test takes
``attention_path``, also on our compiled kernel built for each ISA this CPU runs (AVX2, AVX-512; the
others skip, saying why). test_cpu_kernels.py tests the kernel in float32 and bfloat16 too.

Batches mix decode rows and prefill chunks with contexts that start and end on and off block
boundaries, blocks in scrambled order, padding rows, requests cut across two ubatches (run one
ubatch after the other, as DBO's baton order does), and empty (u)batches; GQA and MLA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dbo import make_ubatch_slices
from moe.kernels import host as kernels_host
from moe.layers import batched_attention
from moe.layers.attention import PagedAttention
from moe.layers.attention_metadata import CommonAttentionMetadata, split_attn_metadata
from moe.layers.attention_tuning import MLALayout
from moe.layers.mla import ABSORB_MAX_QUERY_LEN, PagedMLACache
from moe.platforms import CpuPlatform
from tests.helpers.cpu_kernels import ISAS, kernel_module_for

BLOCK_SIZE = 4
NUM_BLOCKS = 64
DTYPE = torch.float64
# (tokens already in the cache, query rows this step) per request: decodes, prefill chunks that
# start at 0 or mid-sequence, contexts of exactly 1, 2 and 3 blocks, a request with no query row
MIXED = [(0, 5), (7, 1), (15, 1), (3, 9), (0, 1), (11, 2), (8, 4), (4, 0), (2, 6), (5, 3)]


@pytest.fixture(autouse=True)
def torch_path_only(monkeypatch):
    """The padded SDPA chunks, run wherever the compiled kernel is not (GPU, no compiler)."""
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")


@pytest.fixture(params=["sdpa", *ISAS])
def attention_path(request, monkeypatch):
    """The padded SDPA chunks, or our compiled kernel built for each ISA this CPU runs."""
    if request.param != "sdpa":
        monkeypatch.delenv("MOE_DBO_CPU_KERNELS")
        kernel_module_for(request.param)
        platform = CpuPlatform()
        capability = dataclasses.replace(platform.cpu_capability(), isa=request.param)
        monkeypatch.setattr(platform, "cpu_capability", lambda: capability)
        monkeypatch.setattr(kernels_host, "current_platform", lambda: platform)
    return request.param


def make_metadata(
    requests: list[tuple[int, int]],
    *,
    num_padding: int = 0,
    seed: int = 0,
    block_size: int = BLOCK_SIZE,
    num_blocks: int = NUM_BLOCKS,
    max_blocks: int = 6,  # 10 requests * 6 <= NUM_BLOCKS; every seq_len here fits 6 blocks
) -> CommonAttentionMetadata:
    """Metadata for ``requests`` with each request's blocks drawn at random from the cache
    (``num_blocks`` blocks of ``block_size``; ``len(requests) * max_blocks <= num_blocks``)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    qsl, seq_lens, slots = [0], [], []
    for i, (num_computed, q_len) in enumerate(requests):
        seq_len = num_computed + q_len
        block_table[i] = perm[i * max_blocks : (i + 1) * max_blocks].int()
        for pos in range(num_computed, seq_len):
            slots.append(int(block_table[i, pos // block_size]) * block_size + pos % block_size)
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(seq_len)
    num_actual = qsl[-1]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        num_reqs=len(requests),
        num_actual_tokens=num_actual,
        num_tokens=num_actual + num_padding,
        max_query_len=max((q for _, q in requests), default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def prefilled_cache(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A cache already holding (random) K/V of every slot, i.e. of all earlier steps."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def make_gqa(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 8,
    *,
    block_size: int = BLOCK_SIZE,
    num_blocks: int = NUM_BLOCKS,
) -> PagedAttention:
    op = PagedAttention(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim**-0.5
    )
    op.bind_kv_cache(prefilled_cache(op.kv_cache_shape(num_blocks, block_size), seed=1))
    return op


def gqa_inputs(op: PagedAttention, num_tokens: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, op.num_heads * op.head_dim, generator=gen, dtype=DTYPE)
    k = torch.randn(num_tokens, op.num_kv_heads * op.head_dim, generator=gen, dtype=DTYPE)
    v = torch.randn(num_tokens, op.num_kv_heads * op.head_dim, generator=gen, dtype=DTYPE)
    return q, k, v


def test_paged_attention_binds_batched_path_on_cpu():
    assert make_gqa(4, 2).forward_path == "forward_cpu"


@pytest.fixture(params=["one_chunk", "small_chunks", "length_buckets"])
def chunk_bytes(request, monkeypatch):
    """Default chunking (each group in one chunk here), chunks of one to a few requests, or one
    chunk per quarter-octave seq_len bucket (bucketing from 1 token instead of 64)."""
    if request.param == "small_chunks":
        monkeypatch.setattr(batched_attention, "CHUNK_CONTEXT_BYTES", 2000)
    if request.param == "length_buckets":
        monkeypatch.setattr(batched_attention, "SEQ_LEN_BUCKET_MIN", 1)
    return request.param


def test_chunk_bounds_split_by_length_bucket_then_bytes(monkeypatch):
    """Hand-worked: quarter-octave buckets of max(seq_len, 64): 10, 64 -> 24; 70, 76 -> 25
    (log2 6.13, 6.25); 80 -> 26; 200, 200, 200 -> 31; 10-byte tokens, 4000-byte chunks -> 200-token
    requests 2 per chunk."""
    monkeypatch.setattr(batched_attention, "CHUNK_CONTEXT_BYTES", 4000)
    lens = [10, 64, 70, 76, 80, 200, 200, 200]
    assert batched_attention._chunk_bounds(lens, 10) == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
    monkeypatch.setattr(batched_attention, "SEQ_LEN_BUCKETS_PER_OCTAVE", 1)  # octaves: 6, 7, 8
    assert batched_attention._chunk_bounds(lens, 1) == [(0, 2), (2, 5), (5, 8)]


def test_gqa_non_contiguous_cache_takes_dim1_gather():
    """A cache whose K and V halves are not adjacent (not one ``[2 * blocks, -1]`` matrix)
    gathers on dim 1."""
    native, batched = make_gqa(8, 4), make_gqa(8, 4)
    wide = torch.zeros(4, *native.kv_cache.shape[1:], dtype=DTYPE)
    wide[::2] = native.kv_cache
    batched.bind_kv_cache(wide[::2])
    assert not batched.kv_cache.is_contiguous()
    md = make_metadata(MIXED, num_padding=1)
    q, k, v = gqa_inputs(native, md.num_tokens)
    torch.testing.assert_close(
        batched.forward_cpu(q, k, v, md), native.forward_native(q, k, v, md), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_padding", [0, 3])
def test_gqa_batched_equals_native_on_mixed_batch(group, num_padding, chunk_bytes):
    native, batched = make_gqa(4 * group, 4), make_gqa(4 * group, 4)
    assert_forward_cpu_equals_native(native, batched, make_metadata(MIXED, num_padding=num_padding))


def assert_forward_cpu_equals_native(native, op, md) -> None:
    """``op.forward_cpu`` equals ``native.forward_native`` on ``md`` (float64, 1e-12), both
    write the same K/V (padding rows skipped) and ``op`` leaves padding rows zero."""
    q, k, v = gqa_inputs(native, md.num_tokens)
    expected = native.forward_native(q, k, v, md)
    got = op.forward_cpu(q, k, v, md)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(op.kv_cache, native.kv_cache)  # same K/V written, padding skipped
    assert not got[md.num_actual_tokens :].any()


@pytest.mark.parametrize("requests", [[(0, 1)] * 5, [(3, 1), (4, 1), (7, 1), (8, 1)], [(0, 13)]])
def test_gqa_batched_equals_native_decode_only_and_prefill_only(requests, attention_path):
    native, batched = make_gqa(8, 2), make_gqa(8, 2)
    md = make_metadata(requests, num_padding=1)
    q, k, v = gqa_inputs(native, md.num_tokens)
    torch.testing.assert_close(
        batched.forward_cpu(q, k, v, md), native.forward_native(q, k, v, md), rtol=1e-12, atol=1e-12
    )


def test_gqa_request_cut_across_ubatches(chunk_bytes):
    assert_request_cut_across_ubatches_equals_native(make_gqa(8, 4), make_gqa(8, 4))


def assert_request_cut_across_ubatches_equals_native(native, batched):
    """ubatch 0 holds a prefill chunk's first part, ubatch 1 its continuation (full seq_len):
    ``batched.forward_cpu`` on each ubatch in turn equals ``native.forward_native`` on the step
    (both GQA ops over equal caches, 8 / 4 heads of 8)."""
    md = make_metadata([(6, 1), (2, 11), (9, 1), (0, 4)], num_padding=2)
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    assert slices[0].request_slice.stop - 1 == slices[1].request_slice.start  # a request is cut
    q, k, v = gqa_inputs(native, md.num_tokens)
    expected = native.forward_native(q, k, v, md)
    parts = [
        batched.forward_cpu(q[s.token_slice], k[s.token_slice], v[s.token_slice], ub_md)
        for s, ub_md in zip(slices, split_attn_metadata(slices, md), strict=True)
    ]
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_padding", [0, 2])
def test_gqa_empty_ubatch(num_padding, attention_path):
    op = make_gqa(4, 2)
    md = make_metadata([], num_padding=num_padding)
    q, k, v = gqa_inputs(op, num_padding)
    before = op.kv_cache.clone()
    out = op.forward_cpu(q, k, v, md)
    assert out.shape == (num_padding, 4 * 8) and not out.any()
    assert torch.equal(op.kv_cache, before)


MLA_LAYOUT = MLALayout(num_heads=4, nope=6, rope=4, v=5, kv_lora_rank=12)


def make_mla() -> PagedMLACache:
    op = PagedMLACache(MLA_LAYOUT)
    op.bind_kv_cache(prefilled_cache(op.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), seed=3))
    return op


def mla_inputs(op: PagedMLACache, num_tokens: int, *, seed: int = 4) -> dict:
    """q_nope [T, H, nope], q_pe [T, H, rope], kv_b weight [H * (nope + v), r], latents kv_c
    [T, r] / k_pe [T, rope], with the op's layout."""
    lay = op.layout
    gen = torch.Generator().manual_seed(seed)
    t, h = num_tokens, lay.num_heads
    return {
        "q_nope": torch.randn(t, h, lay.nope, generator=gen, dtype=DTYPE),
        "q_pe": torch.randn(t, h, lay.rope, generator=gen, dtype=DTYPE),
        "w": torch.randn(h * (lay.nope + lay.v), lay.kv_lora_rank, generator=gen, dtype=DTYPE),
        "kv_c": torch.randn(t, lay.kv_lora_rank, generator=gen, dtype=DTYPE),
        "k_pe": torch.randn(t, lay.rope, generator=gen, dtype=DTYPE),
    }


def mla_step(op: PagedMLACache, md: CommonAttentionMetadata, method: str, x=None, rows=None):
    """Write this step's latents (rows ``rows`` of the inputs ``x``), then attend with ``method``;
    returns [T, H, v]."""
    x = mla_inputs(op, md.num_tokens) if x is None else x
    rows = slice(0, md.num_tokens) if rows is None else rows
    n = md.num_actual_tokens
    op.write(x["kv_c"][rows][:n], x["k_pe"][rows][:n], md.slot_mapping[:n])
    return getattr(op, method)(x["q_nope"][rows], x["q_pe"][rows], x["w"], md, scale=0.3)


def test_mla_request_cut_across_ubatches(chunk_bytes, attention_path):
    md = make_metadata([(3, 1), (0, 9), (5, 2), (1, 6)], num_padding=1)
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    assert slices[0].request_slice.stop - 1 == slices[1].request_slice.start  # a request is cut
    native, batched = make_mla(), make_mla()
    x = mla_inputs(native, md.num_tokens)
    expected = mla_step(native, md, "forward_native", x)
    parts = [
        mla_step(batched, ub_md, "forward_cpu", x, s.token_slice)
        for s, ub_md in zip(slices, split_attn_metadata(slices, md), strict=True)
    ]
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_padding", [0, 3])
def test_mla_batched_equals_native_absorbed_and_expanded(num_padding, chunk_bytes, attention_path):
    md = make_metadata(MIXED, num_padding=num_padding)
    query_lens = [q for _, q in MIXED]
    assert min(q for q in query_lens if q) <= ABSORB_MAX_QUERY_LEN < max(query_lens)
    native, batched = make_mla(), make_mla()
    expected = mla_step(native, md, "forward_native")
    got = mla_step(batched, md, "forward_cpu")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(batched.kv_cache, native.kv_cache)
    assert not got[md.num_actual_tokens :].any()


def test_mla_empty_batch(attention_path):
    md = make_metadata([], num_padding=1)
    out = mla_step(make_mla(), md, "forward_cpu")
    assert out.shape == (1, MLA_LAYOUT.num_heads, MLA_LAYOUT.v) and not out.any()


def test_chunks_sorted_by_seq_len_and_bounded(monkeypatch):
    """Hand-worked: 4 decode rows (seq 8, 3, 5, 2) and a 6-row chunk; 2-byte tokens, 12-byte
    chunks -> decode chunks of 12 // (8 * 2) = 0 -> 1 request each (ascending seq_len)."""
    monkeypatch.setattr(batched_attention, "CHUNK_CONTEXT_BYTES", 12)
    md = make_metadata([(7, 1), (2, 1), (0, 6), (4, 1), (1, 1)], num_padding=2)
    chunks = batched_attention.pad_request_chunks(
        md, BLOCK_SIZE, short_query_len=1, context_bytes_per_token=2
    )
    assert [(c.num_reqs, c.max_query_len, c.max_seq_len) for c in chunks] == [
        (1, 1, 2),
        (1, 1, 3),
        (1, 1, 5),
        (1, 1, 8),
        (1, 6, 6),
    ]
    assert chunks[0].gather_rows.tolist() == [[9]] and chunks[3].gather_rows.tolist() == [[0]]
    assert chunks[4].gather_rows.tolist() == [[2, 3, 4, 5, 6, 7]]
    monkeypatch.setattr(batched_attention, "CHUNK_CONTEXT_BYTES", 1 << 20)
    decode, prefill = batched_attention.pad_request_chunks(
        md, BLOCK_SIZE, short_query_len=1, context_bytes_per_token=2
    )
    assert decode.gather_rows.flatten().tolist() == [9, 1, 8, 0]  # sorted by seq_len
    assert decode.attn_mask.shape == (4, 1, 8)
    assert decode.attn_mask[1, 0].tolist() == [True] * 3 + [False] * 5  # seq 3: keys 0..2


def test_padding_plan_built_once_per_ubatch_and_shared_by_layers(monkeypatch):
    """Three layers on one (u)batch build the padding plan and KV write slots once; each ubatch
    of a DBO step has its own metadata and so its own plan, and the results equal the reference."""
    calls = []
    real = batched_attention.pad_request_chunks
    monkeypatch.setattr(
        batched_attention,
        "pad_request_chunks",
        lambda md, *a, **kw: calls.append(md) or real(md, *a, **kw),
    )
    layers = [make_gqa(8, 2) for _ in range(3)]
    md = make_metadata(MIXED, num_padding=2)
    q, k, v = gqa_inputs(layers[0], md.num_tokens)
    outs = [layer.forward_cpu(q, k, v, md) for layer in layers]
    assert len(calls) == 1
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    native = make_gqa(8, 2)
    torch.testing.assert_close(outs[0], native.forward_native(q, k, v, md), rtol=1e-12, atol=1e-12)
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    for s, ub_md in zip(slices, split_attn_metadata(slices, md), strict=True):
        for layer in layers:
            layer.forward_cpu(q[s.token_slice], k[s.token_slice], v[s.token_slice], ub_md)
    assert len(calls) == 1 + len(slices)


def test_kv_write_skips_real_rows_without_slot(attention_path):
    """A real row whose slot is -1 is not written, as in the reference ``write_kv_cache``."""
    native, batched = make_gqa(4, 2), make_gqa(4, 2)
    md = make_metadata([(3, 4), (0, 2)])
    slot_mapping = md.slot_mapping.clone()
    slot_mapping[2] = -1
    fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if f.init}
    md = CommonAttentionMetadata(**{**fields, "slot_mapping": slot_mapping})
    q, k, v = gqa_inputs(native, md.num_tokens)
    native.forward_native(q, k, v, md)
    batched.forward_cpu(q, k, v, md)
    assert torch.equal(batched.kv_cache, native.kv_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_equals_bool_mask_bitwise(dtype):
    """The cached additive mask is what SDPA makes of the bool mask: identical outputs."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 4, 8, generator=gen).to(dtype)
    k = torch.randn(3, 2, 7, 8, generator=gen).to(dtype)
    v = torch.randn(3, 2, 7, 8, generator=gen).to(dtype)
    mask = torch.rand(3, 1, 4, 7, generator=gen) < 0.7
    mask[..., 0] = True
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    torch.testing.assert_close(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        rtol=0,
        atol=0,
    )


def test_layers_with_different_plans_share_metadata(monkeypatch, attention_path):
    """Layers whose K/V rows differ in size (so their chunks differ) on one (u)batch's metadata:
    each uses its own plan's gather rows and equals its reference."""
    # float64, head_dim 8: 128 context bytes per token and KV head -> up to 3 requests of 16
    # tokens per chunk with 1 KV head, 1 request with 4
    monkeypatch.setattr(batched_attention, "CHUNK_CONTEXT_BYTES", 8000)
    md = make_metadata(MIXED, num_padding=1)
    for num_kv_heads in (1, 4, 2):
        native, batched = make_gqa(8, num_kv_heads), make_gqa(8, num_kv_heads)
        q, k, v = gqa_inputs(native, md.num_tokens)
        torch.testing.assert_close(
            batched.forward_cpu(q, k, v, md),
            native.forward_native(q, k, v, md),
            rtol=1e-12,
            atol=1e-12,
        )
