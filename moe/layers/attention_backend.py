"""Which implementation attends over the paged KV cache (vLLM's ``--attention-backend``):
``AttentionBackendEnum`` and the checks the platforms call; it imports no platform. The backends
and how the setting is read: docs/hardware.md, "Attention backends: the registry"."""

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
