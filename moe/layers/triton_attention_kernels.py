"""Triton kernels of the TRITON_ATTN backend (``moe.layers.triton_attention`` launches them).

Imports Triton at module level: import this module only when the backend runs (the package keeps
Triton optional). ``@triton.jit`` reads ``TRITON_INTERPRET`` when this module is imported: with
it set, the kernels run in Triton's interpreter on CPU tensors (the CI tests).

Shape legend: T query rows, H query heads, G = H / KV heads (the GQA group), D the key/value
width, R an extra key width (MLA's rope part; 0 for GQA), S a tile of cache positions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold global block ``q_block_idx``: request r's blocks start
    at ``query_start_loc[r] // BLOCK_Q + r`` (strictly increasing in r), found by binary search
    (vLLM's ``find_seq_idx``)."""
    left: tl.int32 = 0  # typed: loop-carried values must keep one type
    right: tl.int32 = num_reqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _query_block(query_start_loc_ptr, num_reqs, BLOCK_Q: tl.constexpr):
    """``(req, q_start, q_len, local_block)`` of this program's query block (``program_id(0)``):
    its request, the request's first row and row count, and the block's index in the request."""
    q_block_idx = tl.program_id(0)
    req = _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    return req, q_start, q_len, q_block_idx - (q_start // BLOCK_Q + req)


@triton.jit
def _tile_rows(
    local_block,
    q_len,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``(kv_head, q_pos, head, row_mask)`` of this program's tile: tile row m is query row
    ``q_pos[m]`` of the request times query head ``head[m]`` (of the ``HEADS_PER_PROGRAM`` of
    head block ``program_id(1) % NUM_HEAD_BLOCKS`` of KV head ``kv_head``'s ``GROUP``)."""
    offs_m = tl.arange(0, BLOCK_M)
    kv_head = tl.program_id(1) // NUM_HEAD_BLOCKS
    head_block = tl.program_id(1) % NUM_HEAD_BLOCKS
    q_pos = local_block * BLOCK_Q + offs_m // HEADS_PER_PROGRAM  # query row in the request
    head_in_group = head_block * HEADS_PER_PROGRAM + offs_m % HEADS_PER_PROGRAM
    head = kv_head * GROUP + head_in_group
    row_mask = (q_pos < q_len) & (head_in_group < GROUP) & (offs_m < BLOCK_Q * HEADS_PER_PROGRAM)
    return kv_head, q_pos, head, row_mask


@triton.jit
def _row_offsets(rows, head, strides, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
    """``(offsets [BLOCK_M, WIDTH_PAD], column mask [WIDTH_PAD])`` of rows ``rows`` x heads
    ``head`` of a ``[T, H, WIDTH]`` operand with ``strides`` (token, head; elements)."""
    offs = tl.arange(0, WIDTH_PAD)
    return rows[:, None] * strides[0] + head[:, None] * strides[1] + offs[None, :], offs < WIDTH


@triton.jit
def _load_rows(ptr, rows, head, strides, row_mask, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
    """``[BLOCK_M, WIDTH_PAD]`` of a ``[T, H, WIDTH]`` operand (``_row_offsets``), 0 outside
    ``row_mask`` and past ``WIDTH``."""
    offsets, col_mask = _row_offsets(rows, head, strides, WIDTH, WIDTH_PAD)
    return tl.load(ptr + offsets, mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _tile_scores(
    q, q_rope, k_cache_ptr, k_rope_cache_ptr, k_base, pos_mask, HEAD_DIM: tl.constexpr, ROPE_DIM
):
    """``(scores [BLOCK_M, TILE]``, float32 (float64 for float64 inputs), ``k [D, TILE]`` in
    q's dtype) of the keys at cache offsets ``k_base [TILE]`` (``pos_mask``: the positions that
    exist), the rope part added when ``ROPE_DIM > 0``."""
    offs_d = tl.arange(0, q.shape[1])
    k = tl.load(  # [D, TILE]
        k_cache_ptr + k_base[None, :] + offs_d[:, None],
        mask=(offs_d < HEAD_DIM)[:, None] & pos_mask[None, :],
        other=0.0,
    ).to(q.dtype)
    scores = tl.dot(q, k, input_precision="ieee")
    if ROPE_DIM > 0:
        offs_r = tl.arange(0, q_rope.shape[1])
        k_rope = tl.load(  # [R, TILE]
            k_rope_cache_ptr + k_base[None, :] + offs_r[:, None],
            mask=(offs_r < ROPE_DIM)[:, None] & pos_mask[None, :],
            other=0.0,
        ).to(q.dtype)
        scores += tl.dot(q_rope, k_rope, input_precision="ieee")
    return scores, k


@triton.jit
def _tile_values(k, v_cache_ptr, v_base, pos_mask, HEAD_DIM: tl.constexpr, V_IS_K: tl.constexpr):
    """``[TILE, D]`` values of the tile in k's dtype: those at cache offsets ``v_base [TILE]``,
    or with ``V_IS_K`` (MLA) the first D elements of the key rows ``k [D, TILE]``."""
    if V_IS_K:
        return tl.trans(k)
    offs_d = tl.arange(0, k.shape[0])
    return tl.load(  # [TILE, D]
        v_cache_ptr + v_base[:, None] + offs_d[None, :],
        mask=pos_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    ).to(k.dtype)


@triton.jit
def _online_softmax_step(m_i, l_i, acc, scores, v):
    """``(m_i, l_i, acc)``, the running row max and sum ``[BLOCK_M]`` and the unnormalised output
    ``[BLOCK_M, D]``, after one tile of ``scores [BLOCK_M, TILE]`` (-inf: not visible) and
    values ``v [TILE, D]``; an all-masked (padding) row keeps max 0 and sum 0."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_context(
    q, q_rope, caches, context, scale, SHAPE: tl.constexpr, ACC_DTYPE: tl.constexpr
):
    """``[BLOCK_M, D]`` attention of the query tile ``q`` (and ``q_rope``) over its request's
    cached context, in tiles of cache positions with an online softmax. ``caches``: ((keys, rope
    keys, values) pointers, (keys', values') (block, slot, head) strides, the KV head);
    ``context``: (the request's block table row, the positions to walk, the last one each tile
    row sees [BLOCK_M], the row mask); ``SHAPE``: (BLOCK_SIZE, TILE, HEAD_DIM, ROPE_DIM, V_IS_K)."""
    cache_ptrs, cache_strides, kv_head = caches
    table_ptr, num_visible, last_visible, row_mask = context
    k_strides, v_strides = cache_strides
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([q.shape[0]], dtype=ACC_DTYPE)
    acc = tl.zeros([q.shape[0], q.shape[1]], dtype=ACC_DTYPE)
    # A while loop: Triton's interpreter cannot take a loaded value as a range bound (its scalars
    # are 1-element arrays, which NumPy 2 refuses to convert to int).
    tile_start: tl.int32 = 0
    while tile_start < num_visible:
        pos = tile_start + tl.arange(0, SHAPE[1])
        pos_mask = pos < num_visible
        block = tl.load(table_ptr + pos // SHAPE[0], mask=pos_mask, other=0).to(tl.int64)
        slot = (pos % SHAPE[0]).to(tl.int64)
        k_base = block * k_strides[0] + slot * k_strides[1] + kv_head * k_strides[2]  # [TILE]
        scores, k = _tile_scores(
            q, q_rope, cache_ptrs[0], cache_ptrs[1], k_base, pos_mask, SHAPE[2], SHAPE[3]
        )
        scores = scores.to(ACC_DTYPE) * scale
        visible = row_mask[:, None] & (pos[None, :] <= last_visible[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        v_base = block * v_strides[0] + slot * v_strides[1] + kv_head * v_strides[2]
        v = _tile_values(k, cache_ptrs[2], v_base, pos_mask, SHAPE[2], SHAPE[4])
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, v)
        tile_start += SHAPE[1]
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_reqs"])
def paged_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    q_rope_ptr,  # [T, H, R] (unused when ROPE_DIM == 0)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, D] (strided)
    k_rope_cache_ptr,  # [num_blocks, block_size, num_kv_heads, R] (strided; unused if R == 0)
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, D] (strided; unused if V_IS_K)
    block_table_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale,
    num_reqs,
    # in elements: out, q, q_rope (token, head); ((block, slot, head) of k, of v); block table's
    strides,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    ROPE_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    V_IS_K: tl.constexpr,
    ACC_DTYPE: tl.constexpr,  # float32; float64 for float64 inputs
):
    """One program: ``BLOCK_Q`` query rows of one request times ``HEADS_PER_PROGRAM`` of the
    ``GROUP`` query heads of one KV head (a [BLOCK_M >= BLOCK_Q * HEADS_PER_PROGRAM, D] tile;
    ``program_id(1)`` = KV head * NUM_HEAD_BLOCKS + head block) over its causal context."""
    out_strides, q_strides, q_rope_strides, cache_strides, table_stride = strides
    req, q_start, q_len, local_block = _query_block(query_start_loc_ptr, num_reqs, BLOCK_Q)
    if local_block * BLOCK_Q >= q_len:  # past the request's rows (or past the last request)
        return
    kv_head, q_pos, head, row_mask = _tile_rows(
        local_block, q_len, GROUP, HEADS_PER_PROGRAM, NUM_HEAD_BLOCKS, BLOCK_Q, BLOCK_M
    )
    rows = (q_start + q_pos).to(tl.int64)
    q = _load_rows(q_ptr, rows, head, q_strides, row_mask, HEAD_DIM, HEAD_DIM_PAD)
    q_rope = q  # read only when ROPE_DIM > 0
    if ROPE_DIM > 0:
        q_rope = _load_rows(
            q_rope_ptr, rows, head, q_rope_strides, row_mask, ROPE_DIM, ROPE_DIM_PAD
        )
    context_len = tl.load(seq_lens_ptr + req) - q_len
    # causal: the block's last row sits at context_len + its index; nothing past it is read
    num_visible = tl.minimum(context_len + (local_block + 1) * BLOCK_Q, context_len + q_len)
    table_ptr = block_table_ptr + req * table_stride
    context = (table_ptr, num_visible, context_len + q_pos, row_mask)
    caches = ((k_cache_ptr, k_rope_cache_ptr, v_cache_ptr), cache_strides, kv_head)
    acc = _attend_context(
        q, q_rope, caches, context, scale, (BLOCK_SIZE, TILE, HEAD_DIM, ROPE_DIM, V_IS_K), ACC_DTYPE
    )
    offsets, col_mask = _row_offsets(rows, head, out_strides, HEAD_DIM, HEAD_DIM_PAD)
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cache_write_kernel(
    slot_mapping_ptr,  # [num_tokens] int64, -1 = no write
    src_a_ptr,  # [num_tokens, WIDTH_A] (row stride src_a_stride)
    src_b_ptr,  # [num_tokens, WIDTH_B]
    dst_a_ptr,  # [num_slots, WIDTH_A] (row stride dst_a_stride)
    dst_b_ptr,  # [num_slots, WIDTH_B]
    src_a_stride,
    src_b_stride,
    dst_a_stride,
    dst_b_stride,
    WIDTH_A: tl.constexpr,
    WIDTH_A_PAD: tl.constexpr,
    WIDTH_B: tl.constexpr,
    WIDTH_B_PAD: tl.constexpr,
):
    """One program per token row: copy its two parts (GQA: K and V; MLA: the latent and the rope
    key) to cache slot ``slot_mapping[row]``, cast to the cache's dtype; skip slot -1."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row)
    if slot < 0:
        return
    offs_a = tl.arange(0, WIDTH_A_PAD)
    a = tl.load(src_a_ptr + row * src_a_stride + offs_a, mask=offs_a < WIDTH_A)
    tl.store(
        dst_a_ptr + slot * dst_a_stride + offs_a,
        a.to(dst_a_ptr.dtype.element_ty),
        mask=offs_a < WIDTH_A,
    )
    offs_b = tl.arange(0, WIDTH_B_PAD)
    b = tl.load(src_b_ptr + row * src_b_stride + offs_b, mask=offs_b < WIDTH_B)
    tl.store(
        dst_b_ptr + slot * dst_b_stride + offs_b,
        b.to(dst_b_ptr.dtype.element_ty),
        mask=offs_b < WIDTH_B,
    )
