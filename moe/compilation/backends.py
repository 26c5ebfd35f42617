"""Graph backends for one piece at one bucket size: inductor on CPU, CUDA graphs on CUDA.

Both take a piece module (``moe.compilation.pieces``) and example row inputs of the bucket's size
and return a callable with the piece's signature that is only valid for inputs of that size.

- ``InductorGraph`` (CPU): the piece is traced with ``make_fx`` as a function of
  (its parameters, its inputs) and compiled with ``torch._inductor.standalone_compile`` (static
  shapes, ``cpp_wrapper``). The parameters are graph INPUTS, so all layers of one structure share
  one compiled graph per bucket, and the graph's FX-cache key does not depend on weight values (the
  on-disk cache then serves any checkpoint of the same shapes). The call skips Dynamo entirely: no
  guards, no recompilation at serving time, nothing thread-local, so the two DBO ubatch threads may
  call it (one at a time, as the baton ensures; the code itself holds no shared mutable state).
- ``CUDAGraphPiece`` (CUDA): ``torch.cuda.CUDAGraph`` capture of the eager piece on static input
  buffers (documented API: warm up on a side stream, then ``torch.cuda.graph``); replay copies the
  inputs in and CLONES the outputs, because the two DBO ubatches replay the same graph in turn and
  the second replay would overwrite the first one's outputs. Written against the documented API;
  its tests are marked ``gpu`` (no GPU in this project's CI).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def has_standalone_compile() -> bool:
    """Whether this torch offers ``torch._inductor.standalone_compile`` (torch >= 2.8)."""
    try:
        from torch._inductor import standalone_compile  # noqa: F401
    except ImportError:
        return False
    return True


def piece_state(piece: nn.Module) -> dict[str, Tensor]:
    """Parameters and buffers of ``piece`` by name (the tensors a traced graph takes as inputs)."""
    return {**dict(piece.named_parameters()), **dict(piece.named_buffers())}


class InductorGraph:
    """One piece compiled by inductor for inputs of one size; call with the state of any layer
    of the same structure: ``graph(state_tensors, *inputs)``.

    ``state_names`` lists the state entries the graph reads (unused parameters, e.g. the experts
    of a layer's MoE block, are dropped from the trace).
    """

    def __init__(self, piece: nn.Module, example_inputs: Sequence[Tensor], *, cpp_wrapper: bool):
        from torch._inductor import config as inductor_config
        from torch._inductor import standalone_compile
        from torch.fx.experimental.proxy_tensor import make_fx

        state = piece_state(piece)
        names = list(state)

        def fn(*args: Tensor):
            values = dict(zip(names, args[: len(names)], strict=True))
            return torch.func.functional_call(piece, values, tuple(args[len(names) :]))

        state_values = [state[n] for n in names]
        gm = make_fx(fn)(*state_values, *example_inputs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        kept = []
        for name, node in zip(names, placeholders[: len(names)], strict=True):
            if node.users:
                kept.append(name)
            else:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
        self.state_names = tuple(kept)
        with inductor_config.patch({"cpp_wrapper": cpp_wrapper, "emulate_precision_casts": True}):
            self._compiled = standalone_compile(
                gm,
                [state[n] for n in kept] + list(example_inputs),
                dynamic_shapes="from_example_inputs",
            )

    def __call__(self, state: Sequence[Tensor], *inputs: Tensor) -> tuple[Tensor, ...]:
        out = self._compiled(*state, *inputs)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


class CUDAGraphPiece:
    """One layer's piece captured as a CUDA graph for inputs of one size (CUDA only).

    Raises:
        RuntimeError: if CUDA is not available.
    """

    def __init__(
        self, piece: nn.Module, example_inputs: Sequence[Tensor], *, num_warmup: int = 2
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAGraphPiece needs a CUDA device")
        self._static_inputs = [t.clone() for t in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # documented recipe: warm up on a side stream
            for _ in range(num_warmup):
                piece(*self._static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            out = piece(*self._static_inputs)
        self._static_outputs = tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        for static, value in zip(self._static_inputs, inputs, strict=True):
            static.copy_(value)
        self._graph.replay()
        return tuple(t.clone() for t in self._static_outputs)


GraphFactory = Callable[[nn.Module, Sequence[Tensor]], Callable[..., tuple[Tensor, ...]]]
