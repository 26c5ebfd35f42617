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
    out_stride_t,
    out_stride_h,
    q_stride_t,
    q_stride_h,
    q_rope_stride_t,
    q_rope_stride_h,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    block_table_stride,
    NUM_HEADS: tl.constexpr,
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
    ``program_id(1)`` = KV head * NUM_HEAD_BLOCKS + head block), walking the request's block
    table over its causal context in tiles of ``TILE`` positions with an online softmax."""
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1) // NUM_HEAD_BLOCKS
    head_block = tl.program_id(1) % NUM_HEAD_BLOCKS
    req = _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block_idx - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:  # past the request's rows (or past the last request)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_s = tl.arange(0, TILE)
    q_pos = local_block * BLOCK_Q + offs_m // HEADS_PER_PROGRAM  # query row in the request
    head_in_group = head_block * HEADS_PER_PROGRAM + offs_m % HEADS_PER_PROGRAM
    head = kv_head * GROUP + head_in_group
    row_mask = (q_pos < q_len) & (head_in_group < GROUP) & (offs_m < BLOCK_Q * HEADS_PER_PROGRAM)
    dim_mask = offs_d < HEAD_DIM
    rows = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        q_ptr + rows[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if ROPE_DIM > 0:
        offs_r = tl.arange(0, ROPE_DIM_PAD)
        rope_mask = offs_r < ROPE_DIM
        q_rope = tl.load(
            q_rope_ptr
            + rows[:, None] * q_rope_stride_t
            + head[:, None] * q_rope_stride_h
            + offs_r[None, :],
            mask=row_mask[:, None] & rope_mask[None, :],
            other=0.0,
        )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=ACC_DTYPE)

    # causal: the block's last row sits at context_len + its index; nothing past it is read
    num_visible = context_len + (local_block + 1) * BLOCK_Q
    if num_visible > seq_len:
        num_visible = seq_len
    # A while loop: Triton's interpreter cannot take a loaded value as a range bound (its scalars
    # are 1-element arrays, which NumPy 2 refuses to convert to int).
    tile_start: tl.int32 = 0
    while tile_start < num_visible:
        pos = tile_start + offs_s
        pos_mask = pos < num_visible
        block = tl.load(
            block_table_ptr + req * block_table_stride + pos // BLOCK_SIZE, mask=pos_mask, other=0
        ).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        k_base = block * k_stride_b + slot * k_stride_s + kv_head * k_stride_h  # [TILE]
        k = tl.load(  # [D, TILE]
            k_cache_ptr + k_base[None, :] + offs_d[:, None],
            mask=dim_mask[:, None] & pos_mask[None, :],
            other=0.0,
        ).to(q.dtype)
        scores = tl.dot(q, k, input_precision="ieee")  # float32 (float64 for float64 inputs)
        if ROPE_DIM > 0:
            k_rope = tl.load(  # [R, TILE]
                k_rope_cache_ptr + k_base[None, :] + offs_r[:, None],
                mask=rope_mask[:, None] & pos_mask[None, :],
                other=0.0,
            ).to(q.dtype)
            scores += tl.dot(q_rope, k_rope, input_precision="ieee")
        scores = scores.to(ACC_DTYPE) * scale
        visible = row_mask[:, None] & (pos[None, :] <= (context_len + q_pos)[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # an all-masked (padding) row
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_IS_K:
            v = tl.trans(k)  # MLA: the values are the first D elements of the key rows
        else:
            v_base = block * v_stride_b + slot * v_stride_s + kv_head * v_stride_h
            v = tl.load(  # [TILE, D]
                v_cache_ptr + v_base[:, None] + offs_d[None, :],
                mask=pos_mask[:, None] & dim_mask[None, :],
                other=0.0,
            ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        tile_start += TILE

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * out_stride_t + head[:, None] * out_stride_h + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


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
