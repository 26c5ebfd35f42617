"""Where GQA paged attention leaves our compiled kernel for torch's SDPA, measured once per machine.

Our kernel computes a few query rows at a time in float32 FMAs; SDPA's flash kernel multiplies
blocks, through the library's GEMMs (AMX tiles on a Xeon), but pads each chunk of requests and,
for a prompt's first chunk, computes the masked half too. Which wins on a long query depends on the
CPU, the dtype and the head layout, so ``kernel_cut`` measures it (``moe.kernels.tuning``): one
request of r query rows, fresh (no cached context) and over r cached tokens, r = 1, 2, 4, ...,
through ``batched_paged_attention`` with every request sent to the kernel, then to SDPA. Results:
docs/hardware.md, "Paged attention kernel".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe.kernels.tuning import best_seconds, measure_max_rows, tuned_max_rows
from moe.layers.attention_metadata import CommonAttentionMetadata
from moe.layers.batched_attention import (
    KERNEL_EVERYWHERE,
    SDPA_EVERYWHERE,
    KernelCut,
    attention_kernels,
    batched_paged_attention,
)

MEASURED_DTYPES = (torch.float32, torch.bfloat16)  # float64 (tests, references): kernel always
MEASURE_BLOCK_SIZE = 16
MEASURE_MAX_MACS = 1 << 28  # the largest call's multiply-adds (QK^T and PV): ~10 ms on one core


def kernel_cut(kv_cache: Tensor, num_heads: int) -> KernelCut:
    """The ``KernelCut`` for a layer of ``num_heads`` query heads over ``kv_cache``
    (``[2, num_blocks, block_size, num_kv_heads, head_dim]``): measured once per machine, dtype
    and head layout where our kernel serves it (a contiguous float32 / bfloat16 CPU cache, the
    kernels built), else ``KERNEL_EVERYWHERE`` (nothing to choose)."""
    kernels = attention_kernels(kv_cache.dtype, kv_cache)
    if kernels is None or kv_cache.dtype not in MEASURED_DTYPES:
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
