"""Small building blocks shared by the model definitions: RMSNorm, rotary embedding, SwiGLU.

Numerics follow HF Mixtral exactly (float32 variance in RMSNorm, ``rotate_half`` RoPE with
``cat(freqs, freqs)``), so our logits can be compared with transformers' to ~1e-6 in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32.

    x: [..., hidden_size], any float dtype; the result has x's dtype (times weight's dtype).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim (HF / GPT-NeoX convention, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding ("default" rope_type) applied per token at its absolute position.

    inv_freq[i] = 1 / theta ** (2i / head_dim); angle = position * inv_freq, duplicated to head_dim.
    """

    def __init__(
        self, head_dim: int, rope_theta: float, *, device: torch.device | str | None = None
    ):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        inv_freq = 1.0 / (
            rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, head_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim]."""
        cos, sin = self.cos_sin(positions, query.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU activation: silu(gate) * up (Mixtral ``hidden_act="silu"``)."""
    return F.silu(gate) * up
