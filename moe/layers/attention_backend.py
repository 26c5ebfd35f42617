"""Which implementation attends over the paged KV cache (vLLM's ``--attention-backend``).

- ``CPU_ATTN``: our compiled CPU kernel reading K/V in place (``moe.kernels``), with long queries
  handed to SDPA past a cut measured once per machine (``moe.layers.attention_tuning``).
- ``TORCH_SDPA``: the requests padded in chunks, one ``scaled_dot_product_attention`` call per
  chunk (``moe.layers.batched_attention``).
- ``TRITON_ATTN``: our Triton kernel reading the paged cache in place, one launch per layer for
  the whole (u)batch, GQA and MLA (``moe.layers.triton_attention``); CUDA's default where Triton
  can launch.
- ``FLEX_ATTENTION``: torch's compiled ``flex_attention`` over the cache in place, one call per
  (u)batch under a block mask built from the block table (``moe.layers.flex_attention``); GQA
  layers only, KV cache blocks a multiple of 16 tokens.

Each platform lists the backends it runs (``Platform.attention_backends``, its default first);
``Platform.check_and_update_config`` refuses the others before any work. The setting is
process-wide, like ``--custom-ops``, and read when an attention op is BUILT: set it
(``moe.layers.attention_selector.set_attention_backend``) before building the model. This module
is the registry the platforms read; it imports no platform. ``forward_native`` is every backend's
reference and ignores the setting.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class AttentionBackendEnum(enum.Enum):
    """The attention implementations (vLLM's names where vLLM has the same one)."""

    CPU_ATTN = "CPU_ATTN"
    TRITON_ATTN = "TRITON_ATTN"
    TORCH_SDPA = "TORCH_SDPA"
    FLEX_ATTENTION = "FLEX_ATTENTION"


# FLEX_ATTENTION's block mask takes the cache block as its KV block; flex_attention's GPU kernels
# tile KV blocks by 16 tokens (vLLM's FlexAttention backend asks the same multiple).
FLEX_BLOCK_SIZE_MULTIPLE = 16


def default_attention_backend(supported: Sequence[str]) -> AttentionBackendEnum:
    """A platform's default backend: the first of its ``Platform.attention_backends``."""
    return AttentionBackendEnum(supported[0])


def check_attention_backend(
    name: str | None, supported: Sequence[str], *, block_size: int
) -> AttentionBackendEnum:
    """The backend ``name`` names, or ``supported[0]`` (the platform's default) for None.

    Raises:
        ValueError: ``name`` is no backend, not in ``supported`` (the platform's list), or
            FLEX_ATTENTION with ``block_size`` not a multiple of ``FLEX_BLOCK_SIZE_MULTIPLE``.
    """
    if name is None:
        return default_attention_backend(supported)
    known = [b.value for b in AttentionBackendEnum]
    if name not in known:
        raise ValueError(f"--attention-backend {name!r} is not one of {known}")
    if name not in supported:
        raise ValueError(
            f"--attention-backend {name} does not run on this platform; choose one of "
            f"{list(supported)}"
        )
    backend = AttentionBackendEnum(name)
    if backend is AttentionBackendEnum.FLEX_ATTENTION and block_size % FLEX_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"--attention-backend FLEX_ATTENTION needs --block-size a multiple of "
            f"{FLEX_BLOCK_SIZE_MULTIPLE}, got {block_size}"
        )
    return backend
