"""Rotary position embedding (Su et al. 2021, RoFormer) as a custom op, with default, linear and
yarn scaling (Peng et al. 2023)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from moe.kernels.host import host_kernels
from moe.platforms.custom_op import CustomOp, is_tracing


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim (HF / GPT-NeoX convention, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    rotary_dim: int,
    rope_theta: float,
    scaling: Mapping[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_factor applied to cos/sin).

    ``scaling``: None for plain RoPE, else the yarn parameters of config.json (``factor``,
    ``original_max_position_embeddings``, optional ``beta_fast``/``beta_slow``/``mscale``/
    ``mscale_all_dim``/``attention_factor``/``truncate``), as transformers reads them.
    """
    pos_freqs = rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope_theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a division by zero
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(scaling: Mapping[str, Any] | None, scale: float) -> float:
    """DeepSeek's softmax-scale correction under yarn: scale * mscale(factor, mscale_all_dim)^2."""
    if scaling and scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        return scale * mscale * mscale
    return scale


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Rotary position embedding applied per token at its absolute position.

    angle[p, i] = p * inv_freq[i]; cos/sin are multiplied by the yarn attention factor (1 without
    scaling). ``forward_native`` computes cos/sin for the given positions on every call;
    ``forward_cpu`` looks them up in a table built once for ``max_position_embeddings`` positions
    (same float32 arithmetic, so bit-identical results); ``forward_cuda`` is ``forward_table``
    (9 ops instead of ``forward_native``'s 20, no host read).
    """

    def __init__(
        self,
        rotary_dim: int,
        rope_theta: float,
        *,
        is_neox_style: bool = True,
        scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int = 4096,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.head_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_factor = rope_inv_freq(
            rotary_dim, rope_theta, scaling, max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._cos_sin_cache: Tensor | None = None  # [max_positions, rotary_dim], built lazily
        # (device, dtype) -> [max_positions, 2 * rotary_dim]: _rotation_table
        self._rotation_tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def _cos_sin_f32(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if self.is_neox_style:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            return x * cos + rotate_half(x) * sin
        # interleaved pairs (x0, x1), (x2, x3), ...: the output keeps the pair layout
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    def forward_native(
        self, positions: Tensor, query: Tensor, key: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Rotate query [num_tokens, num_heads, rotary_dim] and key [num_tokens, num_kv_heads,
        rotary_dim] (any float dtype; returned in their dtypes)."""
        cos, sin = self._cos_sin_f32(positions)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _table(self, device: torch.device) -> Tensor:
        cache = self._cos_sin_cache
        if cache is None or cache.device != device:
            table = torch.arange(self.max_position_embeddings, device=device)
            cache = torch.cat(self._cos_sin_f32(table), dim=-1)
            self._cos_sin_cache = cache
        return cache

    def forward_cpu(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """Our compiled kernel where it applies (``moe.kernels``' ``rotary_embedding``: host
        tensors of one dtype, [num_tokens, heads, rotary_dim] with a contiguous last dim; it checks
        the positions' bound without a host read op and equals ``forward_table`` bit for bit),
        else ``forward_table``; ``forward_native`` for positions past the table."""
        kernel = _rotary_kernel(query, key)
        if kernel is not None:
            table = self._rotation_table(positions.device, query.dtype)
            in_range, q, k = kernel(
                positions.long().contiguous(), query, key, table, self.is_neox_style
            )
            return (q, k) if in_range else self.forward_native(positions, query, key)
        cache = self._table(positions.device)
        # host sync: bound check (a trace has no values to check: graph mode, see forward_table)
        if positions.numel() and not is_tracing() and int(positions.max()) >= cache.shape[0]:
            return self.forward_native(positions, query, key)
        return self.forward_table(positions, query, key)

    def forward_cuda(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """``forward_table``: no bound check, since a device's values cannot be read on the host
        without a sync (and graph capture); the engine keeps positions below
        ``max_position_embeddings`` (``--max-model-len`` is refused beyond it)."""
        return self.forward_table(positions, query, key)

    def _rotation_table(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[max_positions, 2 * rotary_dim]`` in ``dtype``: per position the factors ``_rotate``
        makes of the table in every call, made once: neox style ``[cos, cos, -sin, sin]``,
        interleaved ``[c0, c0, c1, c1, ..., -s0, s0, -s1, s1, ...]``."""
        table = self._rotation_tables.get((device, dtype))
        if table is None:
            cos, sin = self._table(device).chunk(2, dim=-1)
            # rounding is symmetric, so (-sin).to(dtype) == -(sin.to(dtype)): x2 * (-sin) is
            # bit-identical to the reference's (-x2) * sin, and x1 * cos + x2 * (-sin) to its
            # x1 * cos - x2 * sin
            if self.is_neox_style:
                table = torch.cat((cos, cos, -sin, sin), dim=-1)
            else:
                table = torch.cat(
                    (cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), -1).flatten(-2)),
                    dim=-1,
                )
            table = table.to(dtype)
            self._rotation_tables[(device, dtype)] = table
        return table

    def forward_table(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """``forward_cpu`` without its bound check (no host sync, so it traces into a graph): the
        caller guarantees ``0 <= positions < max_position_embeddings`` (the engine does: prompts
        and outputs stop at ``max_model_len`` <= ``max_position_embeddings``)."""
        if query.dtype != key.dtype:
            cos, sin = self._table(positions.device)[positions].chunk(2, dim=-1)
            return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
        # one gather of the per-dtype factors, then 4 ops per tensor (bit-identical to _rotate):
        # x * cos + partner(x) * sin, the partner of element i the other one of its rotated pair
        table = self._rotation_table(positions.device, query.dtype)
        cos, sin = table[positions, None].chunk(2, dim=-1)
        return tuple(x * cos + self._partner(x) * sin for x in (query, key))  # type: ignore[return-value]

    def _partner(self, x: Tensor) -> Tensor:
        half = self.head_dim // 2
        if self.is_neox_style:  # pairs (i, i + half)
            return torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # pairs (2i, 2i + 1)


def _rotary_kernel(query: Tensor, key: Tensor):
    """Our compiled ``rotary_embedding`` (``moe.kernels.host.host_kernels``: host tensors, no trace)
    for ``query`` / ``key`` of one floating dtype, 3-D with a contiguous last dim; else None."""
    if (
        query.dtype != key.dtype
        or query.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        or query.dim() != 3
        or key.dim() != 3
        or query.stride(-1) != 1
        or key.stride(-1) != 1
    ):
        return None
    kernels = host_kernels(query, key)
    return None if kernels is None else kernels.rotary_embedding
