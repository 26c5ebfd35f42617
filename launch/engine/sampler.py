"""Sampler: the next token of every sampled row in a few batched ops.

Greedy rows (temperature 0) take one ``argmax`` over the batch. Rows with a temperature use the
Gumbel-max trick (Gumbel 1954; e.g. Maddison et al. 2014, "A* sampling"): ``argmax(logits / T + g)``
with ``g = -log(-log(u))`` and ``u`` uniform draws a token with probability ``softmax(logits / T)``.

The uniforms are not drawn from a stateful generator but computed by a counter-based hash of
(request seed, output position, vocab index) in torch integer ops — the idea of counter-based RNGs
(Salmon et al., SC 2011 "Parallel random numbers: as easy as 1, 2, 3"); the mixer is Chris
Wellons' ``lowbias32`` (https://nullprogram.com/blog/2018/07/31/). So a request with a given seed
samples the same token at the same output position from the same logits whatever batch, step or
rank it runs in, and after a preemption's recompute; no per-request generator state is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (c split in 16-bit
    halves: each partial product stays below 2**48)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: Tensor) -> Tensor:
    """lowbias32: a bijective 32-bit integer mixer. x: int64 values in [0, 2**32) -> same range."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Uniforms in (0, 1), float64, ``[num_rows, vocab_size]``: a pure function of (seed,
    position, vocab index). seeds: [num_rows] int64 (any value; 64 bits used); positions:
    [num_rows] int64 >= 0."""
    seeds = seeds.to(torch.int64)
    key = mix32(seeds & _MASK32)
    key = mix32(key ^ ((seeds >> 32) & _MASK32))
    key = mix32(key ^ (positions.to(torch.int64) & _MASK32))
    vocab = mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) ^ 0x9E3779B9)
    bits = mix32(key[:, None] ^ vocab[None, :])
    bits = mix32(bits ^ key[:, None])  # a second round: key and vocab index fully mixed
    return (bits.to(torch.float64) + 0.5) * 2.0**-32


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingMetadata:
    """Per sampled row: how to pick its token.

    Fields:
        temperature: [num_rows] float32, 0 = greedy.
        seeds: [num_rows] int64, the request's seed (used only where temperature > 0).
        output_positions: [num_rows] int64, index of the token being sampled among the request's
            output tokens (0 for the first generated token).
        is_all_greedy: True if every temperature is 0 (skips the random path).
    """

    temperature: Tensor
    seeds: Tensor
    output_positions: Tensor
    is_all_greedy: bool


class Sampler:
    """logits [num_rows, vocab_size] (float32) + SamplingMetadata -> token ids [num_rows] int64."""

    def __call__(self, logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        tokens = logits.argmax(dim=-1)
        if metadata.is_all_greedy:
            return tokens
        random_rows = (metadata.temperature > 0).nonzero().flatten()
        temperature = metadata.temperature[random_rows].to(torch.float64)
        uniform = hash_uniform(
            metadata.seeds[random_rows], metadata.output_positions[random_rows], logits.shape[-1]
        )
        gumbel = -torch.log(-torch.log(uniform))
        scores = logits[random_rows].to(torch.float64) / temperature[:, None] + gumbel
        tokens[random_rows] = scores.argmax(dim=-1)
        return tokens
