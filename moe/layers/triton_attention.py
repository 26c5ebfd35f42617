"""TRITON_ATTN: paged attention over the KV cache in place, one Triton launch per layer for a whole
(u)batch, GQA and MLA, after vLLM's unified Triton attention; the KV write is one launch too;
``launches_on`` says where Triton can launch. Grid and algorithm: docs/hardware.md, "TRITON_ATTN
kernel"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from moe.platforms import triton_probe
from moe.platforms.plugins import platform_for

if TYPE_CHECKING:
    from moe.layers.attention_metadata import CommonAttentionMetadata

# query rows x query heads of one program's tile (vLLM's BLOCK_M): tl.dot's least M
BLOCK_M_MIN = 16
# query heads of one KV head that one program attends: wider groups (MLA's 16 to 128 heads over
# one latent head) are split over programs, each reading the KV head's context, so that the
# [BLOCK_M, 512] accumulator of MLA stays in registers
MAX_HEADS_PER_PROGRAM = 16
# cache positions per step of a program's walk: one [TILE, D] key and value tile
TILE_GQA = 32
TILE_MLA = 16  # MLA's key rows are kv_lora_rank + rope wide (576 for DeepSeek)
# warps of an MLA program: with 4, ptxas (sm90) spills its [16, 512] accumulator and tiles
NUM_WARPS_MLA = 8


def launches_on(device: torch.device) -> bool:
    """Whether Triton can launch on ``device``'s tensors here: compiled kernels take CUDA tensors,
    Triton's interpreter host ones. False for host tensors of a CUDA process (the CUDA op paths
    on CPU tensors, as the tests run them on a GPU machine), which then stay in torch."""
    if triton_probe.triton_unavailable_reason() is not None:
        return False
    if platform_for(device).is_triton_target:  # per layer and step on a GPU: no import, no env read
        return True
    import triton  # imported by triton_unavailable_reason already

    return bool(triton.knobs.runtime.interpret)


def launch(kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
    """``kernel[grid](**kwargs)`` (``num_warps`` among them): every Triton launch of this module
    goes through here (tests count them, or compile them for a GPU)."""
    kernel[grid](**kwargs)


def _kernels():
    from moe.layers import triton_attention_kernels  # imports Triton: only when the backend runs

    return triton_attention_kernels


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclass(frozen=True, slots=True)
class _DeviceMetadata:
    """The metadata's tensors on the cache's device (copied once per (u)batch)."""

    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor


def _device_metadata(attn_metadata: CommonAttentionMetadata, device: torch.device):
    def build() -> _DeviceMetadata:
        # host-to-device copies of the runner's host metadata, once per (u)batch; no read back
        return _DeviceMetadata(
            query_start_loc=attn_metadata.query_start_loc.to(device, non_blocking=True),
            seq_lens=attn_metadata.seq_lens.to(device, non_blocking=True),
            block_table=attn_metadata.block_table.to(device, non_blocking=True),
            slot_mapping=attn_metadata.slot_mapping.to(device, non_blocking=True),
        )

    return attn_metadata.derived(("triton_device_metadata", device), build)


def _rows(t: Tensor) -> Tensor:
    """``t`` [num_tokens, ...] as [num_tokens, width] with unit stride along the width."""
    t = t.reshape(t.shape[0], -1)
    return t if t.stride(-1) == 1 else t.contiguous()


def _write_cache(
    parts: tuple[Tensor, Tensor],
    slots: tuple[Tensor, Tensor],
    attn_metadata: CommonAttentionMetadata,
) -> None:
    """Row t of ``parts`` (two [num_tokens, width_i] tensors) to row ``slot_mapping[t]`` of
    ``slots`` (two [num_slots, width_i] views of the cache, unit stride along the width), for the
    ``num_actual_tokens`` real rows; slot -1 skipped. One launch."""
    num_actual = attn_metadata.num_actual_tokens
    if num_actual == 0:
        return
    (src_a, src_b), (dst_a, dst_b) = (_rows(p) for p in parts), slots
    slot_mapping = _device_metadata(attn_metadata, dst_a.device).slot_mapping
    launch(
        _kernels().cache_write_kernel,
        (num_actual,),
        slot_mapping_ptr=slot_mapping,
        src_a_ptr=src_a,
        src_b_ptr=src_b,
        dst_a_ptr=dst_a,
        dst_b_ptr=dst_b,
        src_a_stride=src_a.stride(0),
        src_b_stride=src_b.stride(0),
        dst_a_stride=dst_a.stride(0),
        dst_b_stride=dst_b.stride(0),
        WIDTH_A=src_a.shape[1],
        WIDTH_A_PAD=_pow2(src_a.shape[1], 1),
        WIDTH_B=src_b.shape[1],
        WIDTH_B_PAD=_pow2(src_b.shape[1], 1),
    )


def triton_write_kv_cache(
    key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata: CommonAttentionMetadata
) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] of the real rows into ``kv_cache``
    [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous) at the metadata's
    ``slot_mapping``; one launch."""
    width = kv_cache.shape[3] * kv_cache.shape[4]
    _write_cache(
        (key, value), (kv_cache[0].view(-1, width), kv_cache[1].view(-1, width)), attn_metadata
    )


def triton_write_mla_cache(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, attn_metadata: CommonAttentionMetadata
) -> None:
    """kv_c [num_tokens, kv_lora_rank] and k_pe [num_tokens, rope] of the real rows into the
    latent cache [num_blocks, block_size, kv_lora_rank + rope] (contiguous); one launch."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    kv_lora_rank = kv_c.shape[-1]
    _write_cache((kv_c, k_pe), (flat[:, :kv_lora_rank], flat[:, kv_lora_rank:]), attn_metadata)


def _strides(
    out: Tensor, q: Tensor, q_rope: Tensor | None, k_cache: Tensor, v_cache: Tensor, table: Tensor
) -> tuple:
    """The attention kernel's ``strides`` (elements) of its row-major operands: out, q, q_rope
    (token, head), the K and V caches ((block, slot, head) each), the block table (row)."""
    q_rope_strides = (0, 0) if q_rope is None else (q_rope.stride(0), q_rope.stride(1))
    return (
        (out.stride(0), out.stride(1)),
        (q.stride(0), q.stride(1)),
        q_rope_strides,
        (k_cache.stride()[:3], v_cache.stride()[:3]),
        table.stride(0),
    )


def _attend(
    out: Tensor,
    query: tuple[Tensor, Tensor | None],
    cache: tuple[Tensor, Tensor | None, Tensor | None],
    attn_metadata: CommonAttentionMetadata,
    *,
    scale: float,
) -> None:
    """The launch: ``out`` [T, H, D] <- attention of ``query`` (q [T, H, D], q_rope [T, H, R] or
    None) over ``cache`` (keys [num_blocks, block_size, num_kv_heads, D], rope keys of width R
    or None, values like the keys or None when they are the keys)."""
    q, q_rope = query
    k_cache, k_rope_cache, v_cache = cache
    num_reqs, num_tokens = attn_metadata.num_reqs, attn_metadata.num_tokens
    if num_reqs == 0 or attn_metadata.num_actual_tokens == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    heads_per_program = min(group, MAX_HEADS_PER_PROGRAM)
    num_head_blocks = -(-group // heads_per_program)
    block_m = max(BLOCK_M_MIN, _pow2(heads_per_program))
    block_q = block_m // heads_per_program
    rope_dim = 0 if q_rope is None else q_rope.shape[2]
    v_is_k = v_cache is None
    v_cache = k_cache if v_is_k else v_cache
    meta = _device_metadata(attn_metadata, q.device)
    kernels = _kernels()
    launch(
        kernels.paged_attention_kernel,
        (num_tokens // block_q + num_reqs, num_kv_heads * num_head_blocks),
        out_ptr=out,
        q_ptr=q,
        q_rope_ptr=q if q_rope is None else q_rope,
        k_cache_ptr=k_cache,
        k_rope_cache_ptr=k_cache if k_rope_cache is None else k_rope_cache,
        v_cache_ptr=v_cache,
        block_table_ptr=meta.block_table,
        seq_lens_ptr=meta.seq_lens,
        query_start_loc_ptr=meta.query_start_loc,
        scale=scale,
        num_reqs=num_reqs,
        strides=_strides(out, q, q_rope, k_cache, v_cache, meta.block_table),
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        NUM_HEAD_BLOCKS=num_head_blocks,
        BLOCK_SIZE=block_size,
        TILE=TILE_GQA if rope_dim == 0 else TILE_MLA,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_pow2(head_dim),
        ROPE_DIM=rope_dim,
        ROPE_DIM_PAD=_pow2(rope_dim),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        V_IS_K=v_is_k,
        ACC_DTYPE=kernels.tl.float64 if q.dtype == torch.float64 else kernels.tl.float32,
        num_warps=4 if rope_dim == 0 else NUM_WARPS_MLA,
    )


def triton_paged_attention(
    query: Tensor, kv_cache: Tensor, attn_metadata: CommonAttentionMetadata, *, scale: float
) -> Tensor:
    """GQA attention of every query row over its request's cached context, in one launch.

    Args:
        query: [num_tokens, num_heads, head_dim] (rotated), float32, bfloat16, float16 or
            float64; last dimension contiguous.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (this step's K/V already
            written: ``triton_write_kv_cache``), any float dtype (cast to query's when read).
        attn_metadata: query_start_loc / seq_lens / block_table of this (u)batch.
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype; rows of no request are zero.
    """
    out = torch.zeros_like(query)
    query = query if query.stride(-1) == 1 else query.contiguous()
    _attend(out, (query, None), (kv_cache[0], None, kv_cache[1]), attn_metadata, scale=scale)
    return out


def triton_mla_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_b_weight: Tensor,
    kv_cache: Tensor,
    attn_metadata: CommonAttentionMetadata,
    *,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """MLA of every query row in the absorbed form, in one attention launch over the latent cache.

    Args:
        q_nope: [num_tokens, num_heads, nope]; q_pe: [num_tokens, num_heads, rope] (rotated).
        kv_b_weight: [num_heads * (nope + v), kv_lora_rank] (``kv_b_proj.weight``).
        kv_cache: [num_blocks, block_size, kv_lora_rank + rope] (this step's rows written:
            ``triton_write_mla_cache``).

    Returns:
        [num_tokens, num_heads, v] in q_nope's dtype; rows of no request are zero.
    """
    num_tokens, num_heads, nope = q_nope.shape
    w_kv = kv_b_weight.view(num_heads, -1, kv_lora_rank)  # [H, nope + v, r]
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r] (a view)
    o_lat = q_lat.new_zeros(num_tokens, num_heads, kv_lora_rank)
    latents = kv_cache[:, :, None]  # [num_blocks, block_size, 1, r + rope]: one KV head
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    cache = (latents[..., :kv_lora_rank], latents[..., kv_lora_rank:], None)
    _attend(o_lat, (q_lat, q_pe), cache, attn_metadata, scale=scale)
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
