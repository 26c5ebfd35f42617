"""Graph mode: a causal LM whose pure-compute pieces run as graphs, one per padding bucket.

``GraphModeModel`` wraps a built and loaded ``MoEForCausalLM`` and offers the same
``forward(input_ids, positions, attn_metadata)`` / ``compute_logits``. A forward of ``n`` rows
(one ubatch under DBO: each ubatch picks its own bucket) with ``n`` <= the largest bucket:

1. pads ``input_ids`` / ``positions`` with zeros to the bucket ``b`` (smallest >= n) and embeds;
2. per layer runs ``AttnIn`` and ``AttnOut`` (``moe.compilation.pieces``) as graphs of size ``b``;
   the attention core and the MoE kernel (dispatch, experts, combine, shared experts, and with
   them every ``dbo_yield``) run eagerly on the first ``n`` rows, and their outputs are padded
   back to ``b`` rows for the next piece;
3. ``Final`` as a graph; returns the first ``n`` rows.

Padding rows never reach the KV cache (the attention core only sees the first ``n`` rows, and rows
past ``num_actual_tokens`` of those are the model runner's own padding, which it never caches) nor
the all-to-all. A forward above the largest bucket (or before ``capture``) runs the wrapped model
eagerly. ``capture`` compiles every graph at start-up (tqdm progress); nothing compiles later.
(Piecewise graphs after vLLM's ``CUDAGraphWrapper`` / ``PiecewiseBackend``; see
``shared/seeds/graph-capture-bucketing.md``.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dbo.timeline.recorder import set_timeline_layer, timeline_span
from moe.compilation.backends import CUDAGraphPiece, InductorGraph, piece_state
from moe.compilation.config import bucket_for
from moe.compilation.pieces import AttnIn, AttnOut, Final, is_gqa, is_moe

BACKENDS = ("inductor", "cuda_graph")


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureStats:
    """What ``GraphModeModel.capture`` built: graphs, seconds, and the buckets."""

    num_graphs: int
    seconds: float
    capture_sizes: tuple[int, ...]
    backend: str


def pad_rows(x: Tensor, num_rows: int) -> Tensor:
    """``x`` [n, ...] zero-padded to [num_rows, ...] (``x`` itself when n == num_rows)."""
    n = x.shape[0]
    if n == num_rows:
        return x
    out = x.new_zeros((num_rows, *x.shape[1:]))
    out[:n] = x
    return out


def _structure_key(piece: nn.Module) -> tuple:
    """Pieces with equal keys trace to the same graph (same code, state shapes and dtypes)."""
    layer = getattr(piece, "layer", None)
    flags = () if layer is None else (is_gqa(layer), is_moe(layer))
    state = tuple((n, tuple(t.shape), t.dtype) for n, t in piece_state(piece).items())
    return (type(piece).__name__, *flags, state)


class GraphModeModel(nn.Module):
    """``MoEForCausalLM`` with its pieces run as graphs per bucket (see the module docstring).

    Args:
        causal_lm: the built model, weights loaded (graphs are captured from its current state).
        capture_sizes: ascending buckets (``moe.compilation.config.resolve_capture_sizes``).
        backend: ``"inductor"`` (CPU) or ``"cuda_graph"``.

    Raises:
        ValueError: empty ``capture_sizes`` or an unknown backend.
    """

    def __init__(
        self, causal_lm: nn.Module, capture_sizes: tuple[int, ...], *, backend: str = "inductor"
    ):
        super().__init__()
        if not capture_sizes:
            raise ValueError("graph mode needs at least one capture size")
        if backend not in BACKENDS:
            raise ValueError(f"graph backend {backend!r} is not one of {BACKENDS}")
        self.lm = causal_lm
        self.capture_sizes = tuple(capture_sizes)
        self.backend = backend
        model = causal_lm.model
        layers = list(model.layers)
        # plain lists: the pieces share the model's modules, they are not extra submodules
        self._attn_in = [AttnIn(layer, is_first=False) for layer in layers]
        self._attn_out = [AttnOut(layer) for layer in layers]
        self._final = Final(model)
        self._pieces: list[nn.Module] = [*self._attn_in, *self._attn_out, self._final]
        self._graphs: dict[tuple[int, int], object] = {}  # (piece index, bucket) -> graph
        self._states: list[list[Tensor]] = []
        self.is_captured = False

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm.compute_logits(hidden_states)

    def _example_inputs(self, piece: nn.Module, num_rows: int) -> list[Tensor]:
        ref = self.lm.model.embed_tokens.weight
        hidden = ref.new_zeros((num_rows, ref.shape[1]))
        if isinstance(piece, AttnIn):
            return [hidden, hidden.clone(), torch.zeros(num_rows, dtype=torch.int64)]
        if isinstance(piece, AttnOut):
            attn = piece.layer.self_attn
            width = attn.o_proj.in_features if is_gqa(piece.layer) else ref.shape[1]
            return [hidden, ref.new_zeros((num_rows, width))]
        return [hidden, hidden.clone()]

    @torch.no_grad()
    def capture(self, *, progress: bool = True) -> CaptureStats:
        """Compile (inductor) or capture (CUDA graphs) every piece at every bucket; idempotent.

        Inductor graphs are shared by the pieces of equal structure (all MoE layers' ``AttnOut``,
        ...), so their number is (distinct pieces) x (buckets), not layers x buckets.
        """
        from tqdm import tqdm

        start = time.perf_counter()
        keys = [_structure_key(p) for p in self._pieces]
        if self.backend == "inductor":
            owners = {key: keys.index(key) for key in keys}  # first piece of each structure
            jobs = [(i, b) for i in sorted(set(owners.values())) for b in self.capture_sizes]
        else:
            owners = {}
            jobs = [(i, b) for i in range(len(self._pieces)) for b in self.capture_sizes]
        with torch.inference_mode():
            for (
                piece
            ) in self._pieces:  # eager once: lazily built tables (RoPE) exist before tracing
                piece(*self._example_inputs(piece, self.capture_sizes[0]))
            bar = tqdm(
                jobs, desc=f"graph mode ({self.backend})", unit="graph", disable=not progress
            )
            for index, bucket in bar:
                piece = self._pieces[index]
                example = self._example_inputs(piece, bucket)
                if self.backend == "inductor":
                    graph = InductorGraph(piece, example, cpp_wrapper=True)
                else:
                    graph = CUDAGraphPiece(piece, example)
                self._graphs[(index, bucket)] = graph
            if self.backend == "inductor":
                for i, key in enumerate(keys):
                    for bucket in self.capture_sizes:
                        self._graphs[(i, bucket)] = self._graphs[(owners[key], bucket)]
                self._states = [
                    [
                        piece_state(p)[n]
                        for n in self._graphs[(i, self.capture_sizes[0])].state_names
                    ]
                    for i, p in enumerate(self._pieces)
                ]
        self.is_captured = True
        return CaptureStats(
            num_graphs=len(jobs),
            seconds=time.perf_counter() - start,
            capture_sizes=self.capture_sizes,
            backend=self.backend,
        )

    def _run(self, piece_index: int, bucket: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        graph = self._graphs[(piece_index, bucket)]
        if self.backend == "inductor":
            return graph(self._states[piece_index], *inputs)
        return graph(*inputs)

    # no_grad, not inference_mode: as MoEForCausalLM.forward (a recv hook may finalize a combine
    # outside the caller's inference mode)
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attn_metadata) -> Tensor:
        """input_ids, positions: [n] int64 -> hidden_states [n, hidden_size] (as the wrapped model)."""
        n = input_ids.shape[0]
        bucket = bucket_for(n, self.capture_sizes) if self.is_captured else None
        if bucket is None:
            return self.lm(input_ids, positions, attn_metadata)
        model = self.lm.model
        num_layers = len(self._attn_in)
        positions_padded = pad_rows(positions, bucket)
        h = model.embed_tokens(pad_rows(input_ids, bucket))
        mlp_out = torch.zeros_like(h)  # layer 0: h + 0 == h exactly
        for i, layer in enumerate(model.layers):
            set_timeline_layer(i)  # names this thread's spans layer{i}.attention, ...
            with timeline_span("attention"):
                outs = self._run(i, bucket, h, mlp_out, positions_padded)
                residual = outs[0]
                if is_gqa(layer):
                    q, k, v = (t[:n] for t in outs[1:])
                    attn_output = layer.self_attn.attn(q, k, v, attn_metadata)
                else:
                    attn_output = layer.self_attn(positions, outs[1][:n], attn_metadata)
            with timeline_span("router"):
                outs = self._run(num_layers + i, bucket, residual, pad_rows(attn_output, bucket))
            if len(outs) == 2:  # dense MLP layer: all of it ran in the graph
                h, mlp_out = outs
                continue
            h, y, topk_weights, topk_ids = outs
            mlp = getattr(layer, layer.mlp_name)
            shared = mlp._shared_experts if mlp.shared_expert_name else None
            routed = mlp.kernel.forward(
                y[:n], topk_ids[:n], topk_weights[:n], shared_experts=shared
            )
            mlp_out = pad_rows(routed, bucket)
        set_timeline_layer(None)
        (hidden_states,) = self._run(2 * num_layers, bucket, h, mlp_out)
        return hidden_states[:n]
