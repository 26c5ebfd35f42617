"""Graph mode (``GraphModeModel``): the model's own forward traced per padding bucket with
``make_fx``, cut at its splitting ops and its pieces compiled or captured, after vLLM's piecewise
backend. How and why: docs/hardware.md, "Graph mode" and "Piecewise graph mode"."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dbo.timeline.recorder import is_timeline_active, timeline_span
from moe.compilation.backends import InductorGraph
from moe.compilation.config import bucket_for
from moe.compilation.pieces import Piece, SplitForward, split_forward, structure_key, trace_forward
from moe.compilation.splitting import graph_forward, pad_rows

__all__ = ["CaptureStats", "GraphModeModel", "pad_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureStats:
    """What ``GraphModeModel.capture`` built: graphs, seconds, and the buckets."""

    num_graphs: int
    seconds: float
    capture_sizes: tuple[int, ...]
    backend: str
    num_whole_graphs: int = 0  # decode-only forwards captured whole (FULL_AND_PIECEWISE)


def _spanned(graph: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple[Tensor, ...]]:
    """``graph`` recorded as a ``graph`` compute span (of the current layer) on the timeline."""

    def run(*args: Tensor) -> tuple[Tensor, ...]:
        if not is_timeline_active():
            return graph(*args)
        with timeline_span("graph"):
            return graph(*args)

    return run


class GraphModeModel(nn.Module):
    """A causal LM whose forward runs as compiled pieces per bucket (see the module docstring).

    Args:
        causal_lm: the built model, weights loaded (graphs are captured from its current state);
            ``forward(input_ids [n] int64, positions [n] int64, attn_metadata) -> [n, hidden]``.
        capture_sizes: ascending buckets (``moe.compilation.config.resolve_capture_sizes``).
        backend: the piece backend class (``moe.compilation.backends``; the platform's
            ``graph_backend()``): ``InductorGraph`` (CPU) or ``CUDAGraphPiece``.

    Raises:
        ValueError: empty ``capture_sizes``.
    """

    def __init__(
        self, causal_lm: nn.Module, capture_sizes: tuple[int, ...], *, backend=InductorGraph
    ):
        super().__init__()
        if not capture_sizes:
            raise ValueError("graph mode needs at least one capture size")
        self.lm = causal_lm
        self.capture_sizes = tuple(capture_sizes)
        self.backend = backend
        self._forwards: dict[int, SplitForward] = {}  # bucket -> its split, compiled forward
        self._stats: CaptureStats | None = None
        self._whole = None

    def set_whole_forward(self, whole) -> None:
        """Run forwards through ``whole`` where it has a graph: ``whole.bucket_for(num_rows,
        attn_metadata) -> int | None`` and ``whole.replay(bucket, input_ids, positions,
        attn_metadata) -> [num_rows, hidden_size]`` (``launch.engine.decode_graphs``)."""
        self._whole = whole

    @property
    def is_captured(self) -> bool:
        return self._stats is not None

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm.compute_logits(hidden_states)

    @torch.no_grad()
    def capture(self, *, progress: bool = True) -> CaptureStats:
        """Trace, split and compile (inductor) or capture (CUDA graphs) the forward at every
        bucket; idempotent. See the module docstring."""
        from tqdm import tqdm

        if self._stats is not None:
            return self._stats
        start = time.perf_counter()
        with torch.inference_mode():
            capture = self.backend.captures_capturable
            # builds the lazy tables (RoPE) from real values
            trace_forward(self.lm, self.capture_sizes[0], real=True, capture_capturable=capture)
            splits = {
                b: split_forward(trace_forward(self.lm, b, capture_capturable=capture))
                for b in self.capture_sizes
            }
            groups = self._group_pieces(splits)
            bar = tqdm(
                groups, desc=f"graph mode ({self.backend.name})", unit="graph", disable=not progress
            )
            for pieces in bar:
                graph = _spanned(self._compile_piece(pieces[0][1]))
                for bucket, piece in pieces:
                    splits[bucket].bind(piece.name, graph)
        for split in splits.values():
            split.pieces.clear()  # their example inputs and uncompiled graphs are not needed now
        self._forwards = splits
        self._stats = CaptureStats(
            num_graphs=len(groups),
            seconds=time.perf_counter() - start,
            capture_sizes=self.capture_sizes,
            backend=self.backend.name,
        )
        return self._stats

    def _group_pieces(self, splits: dict[int, SplitForward]) -> list[list[tuple[int, Piece]]]:
        """Pieces that one graph serves: those of equal structure and constants (inductor, whose
        graphs take the weights as inputs), else each piece alone (CUDA graphs)."""
        groups: dict[str, list[tuple[list[Tensor], list[tuple[int, Piece]]]]] = {}
        alone = []
        for bucket, split in splits.items():
            for piece in split.pieces:
                if not self.backend.shares_graphs:
                    alone.append([(bucket, piece)])
                    continue
                key, constants = structure_key(piece.module, piece.example)
                candidates = groups.setdefault(key, [])
                for other, members in candidates:
                    if all(torch.equal(a, b) for a, b in zip(constants, other, strict=True)):
                        members.append((bucket, piece))
                        break
                else:
                    candidates.append((constants, [(bucket, piece)]))
        return alone + [members for entries in groups.values() for _, members in entries]

    def _compile_piece(self, piece: Piece) -> Callable[..., tuple[Tensor, ...]]:
        return self.backend.for_piece(piece.module, piece.example, piece.is_weight)

    # no_grad, not inference_mode: as MoEForCausalLM.forward (a recv hook may finalize a combine
    # outside the caller's inference mode)
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attn_metadata) -> Tensor:
        """input_ids, positions: [n] int64 -> hidden_states [n, hidden_size] (as the wrapped
        model does)."""
        n = input_ids.shape[0]
        if self._whole is not None:
            whole_bucket = self._whole.bucket_for(n, attn_metadata)
            if whole_bucket is not None:
                return self._whole.replay(whole_bucket, input_ids, positions, attn_metadata)
        bucket = bucket_for(n, self.capture_sizes) if self.is_captured else None
        if bucket is None:
            return self.lm(input_ids, positions, attn_metadata)
        with graph_forward(n, attn_metadata):
            hidden_states = self._forwards[bucket](
                pad_rows(input_ids, bucket), pad_rows(positions, bucket)
            )
        return hidden_states[:n]
