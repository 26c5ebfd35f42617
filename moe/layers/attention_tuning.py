"""Where paged attention leaves our compiled kernel for torch's SDPA, measured once per machine:
``kernel_cut`` (GQA) and ``mla_expanded_cut`` (MLA's expanded requests). What is measured:
docs/hardware.md, "Attention kernel cut"."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from moe.kernels.tuning import MEASURE_MAX_MACS, best_seconds, measure_max_rows, tuned_max_rows
from moe.layers.attention_metadata import CommonAttentionMetadata
from moe.layers.batched_attention import (
    KERNEL_EVERYWHERE,
    SDPA_EVERYWHERE,
    KernelCut,
    attention_kernels,
    batched_paged_attention,
)
from moe.layers.batched_mla import batched_mla_attention

MEASURED_DTYPES = (torch.float32, torch.bfloat16)  # float64 (tests, references): kernel always
MEASURE_BLOCK_SIZE = 16


def _measured_kernels(kv_cache: Tensor) -> ModuleType | None:
    """The kernel build whose cut over ``kv_cache`` is measured: where our kernel attends over
    it (``attention_kernels``) in a dtype of ``MEASURED_DTYPES``; else None (nothing to choose)."""
    if kv_cache.dtype not in MEASURED_DTYPES:
        return None
    return attention_kernels(kv_cache.dtype, kv_cache)


def kernel_cut(kv_cache: Tensor, num_heads: int) -> KernelCut:
    """The ``KernelCut`` for a layer of ``num_heads`` query heads over ``kv_cache``
    (``[2, num_blocks, block_size, num_kv_heads, head_dim]``): measured once per machine, dtype
    and head layout where our kernel serves it (a contiguous float32 / bfloat16 CPU cache, the
    kernels built), else ``KERNEL_EVERYWHERE`` (nothing to choose)."""
    kernels = _measured_kernels(kv_cache)
    if kernels is None:
        return KERNEL_EVERYWHERE
    num_kv_heads, head_dim = kv_cache.shape[3:]
    layout = (num_heads, num_kv_heads, head_dim, kv_cache.dtype)
    case = f"attention {kv_cache.dtype} heads={num_heads}/{num_kv_heads} head_dim={head_dim}"
    return KernelCut(
        fresh=tuned_max_rows(
            kernels, f"{case} fresh", lambda: _measure(*layout, over_context=False)
        ),
        over_context=tuned_max_rows(
            kernels, f"{case} over_context", lambda: _measure(*layout, over_context=True)
        ),
    )


@torch.inference_mode()
def _measure(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *, over_context: bool
) -> float:
    """``measure_max_rows`` on one request of r query rows, over r cached tokens or none (random
    data from a generator of its own: the global RNG is left as it was)."""
    gen = torch.Generator().manual_seed(0)

    def seconds(kernel: bool, rows: int) -> float:
        requests = [(rows if over_context else 0, rows)]
        metadata, num_blocks = CommonAttentionMetadata.for_requests(requests, MEASURE_BLOCK_SIZE)
        shape = (2, num_blocks, MEASURE_BLOCK_SIZE, num_kv_heads, head_dim)
        kv_cache = torch.randn(shape, generator=gen).to(dtype)
        query = torch.randn(rows, num_heads, head_dim, generator=gen).to(dtype)
        cut = KERNEL_EVERYWHERE if kernel else SDPA_EVERYWHERE
        scale = head_dim**-0.5
        return best_seconds(
            lambda: batched_paged_attention(query, kv_cache, metadata, scale=scale, cut=cut)
        )

    # rows x (context + rows) key positions per query head, twice (scores, weighted sum); the
    # padded SDPA of a fresh chunk computes the whole square too
    per_row_squared = 2 * num_heads * head_dim * (2 if over_context else 1)
    return measure_max_rows(seconds, math.isqrt(MEASURE_MAX_MACS // per_row_squared))


@dataclass(frozen=True, slots=True, kw_only=True)
class MLALayout:
    """The head layout of an MLA layer: query heads, the no-RoPE and RoPE query/key widths, the
    value width and the latent rank (``moe.layers.mla``; DeepSeek's ``num_attention_heads``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``kv_lora_rank``)."""

    num_heads: int
    nope: int
    rope: int
    v: int
    kv_lora_rank: int

    @classmethod
    def from_config(cls, config) -> MLALayout:
        """The layout of an MLA model's layers (``MoEModelConfig``)."""
        return cls(
            num_heads=config.num_attention_heads,
            nope=config.qk_nope_head_dim,
            rope=config.qk_rope_head_dim,
            v=config.v_head_dim,
            kv_lora_rank=config.kv_lora_rank,
        )


def mla_expanded_cut(kv_cache: Tensor, layout: MLALayout, absorb_max_query_len: int) -> float:
    """Query rows up to which MLA's expanded requests attend in our kernel over ``kv_cache``
    (``[num_blocks, block_size, kv_lora_rank + rope]``), past which their chunks go to the padded
    SDPA (``batched_mla_attention``'s ``expanded_cut``): measured once per machine, dtype and
    layout where the kernel serves it (``kernel_cut``'s conditions), else ``inf``."""
    kernels = _measured_kernels(kv_cache)
    if kernels is None:
        return math.inf
    case = (
        f"mla {kv_cache.dtype} heads={layout.num_heads} nope={layout.nope} rope={layout.rope} "
        f"v={layout.v} kv_lora_rank={layout.kv_lora_rank} expanded"
    )
    measure = functools.partial(_measure_mla, layout, kv_cache.dtype, absorb_max_query_len)
    return tuned_max_rows(kernels, case, measure)


@torch.inference_mode()
def _measure_mla(layout: MLALayout, dtype: torch.dtype, absorb_max_query_len: int) -> float:
    """``measure_max_rows`` on one fresh request of r > ``absorb_max_query_len`` query rows (the
    expanded form) through ``batched_mla_attention``, random data from a generator of its own."""
    gen = torch.Generator().manual_seed(0)
    h, r = layout.num_heads, layout.kv_lora_rank
    kv_b_weight = (torch.randn(h * (layout.nope + layout.v), r, generator=gen) * r**-0.5).to(dtype)

    def seconds(kernel: bool, rows: int) -> float:
        metadata, num_blocks = CommonAttentionMetadata.for_requests([(0, rows)], MEASURE_BLOCK_SIZE)
        shape = (num_blocks, MEASURE_BLOCK_SIZE, r + layout.rope)
        kv_cache = torch.randn(shape, generator=gen).to(dtype)
        q_nope = torch.randn(rows, h, layout.nope, generator=gen).to(dtype)
        q_pe = torch.randn(rows, h, layout.rope, generator=gen).to(dtype)
        call = functools.partial(
            batched_mla_attention,
            q_nope,
            q_pe,
            kv_b_weight,
            kv_cache,
            metadata,
            kv_lora_rank=r,
            scale=(layout.nope + layout.rope) ** -0.5,
            absorb_max_query_len=absorb_max_query_len,
            expanded_cut=math.inf if kernel else 0.0,
        )
        return best_seconds(call)

    # rows x rows key positions per head: scores over nope + rope, the weighted sum over v
    per_row_squared = h * (layout.nope + layout.rope + layout.v)
    max_rows = math.isqrt(MEASURE_MAX_MACS // per_row_squared)
    return measure_max_rows(seconds, max_rows, first=2 * absorb_max_query_len)
