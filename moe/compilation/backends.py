"""Graph backends for one piece at one bucket size: inductor on CPU, CUDA graphs on CUDA. The
platform hands out the class (``Platform.graph_backend()``); each offers ``name``,
``shares_graphs`` (one graph may serve pieces of equal structure: their weights are inputs),
``captures_capturable`` (``capturable`` splitting ops, the MoE kernels without communication,
are traced into its graphs: their device path must read nothing to the host),
``unavailable_reason()`` and ``for_piece(module, example_inputs, is_weight)``.

A piece is an FX ``GraphModule`` cut out of the traced model forward
(``moe.compilation.piecewise``): a pure function of its inputs, the weights it reads among them.

- ``InductorGraph`` (CPU): ``torch._inductor.standalone_compile`` of the piece (static shapes,
  ``cpp_wrapper``, eager's precision casts emulated). The weights are graph INPUTS, so pieces of
  equal structure (the same code of every layer) share one compiled graph per bucket, and the
  graph's FX-cache key does not depend on weight values (the on-disk cache then serves any
  checkpoint of the same shapes). The call skips Dynamo entirely: no guards, no recompilation at
  serving time, nothing thread-local, so the two DBO ubatch threads may call it (one at a time, as
  the baton ensures; the code itself holds no shared mutable state).
- ``CUDAGraphPiece`` (CUDA): ``torch.cuda.CUDAGraph`` capture of the piece on static input
  buffers (documented API: warm up on a side stream, then ``torch.cuda.graph``); the weights are
  captured in place, replay copies the other inputs in and CLONES the outputs, because the two DBO
  ubatches replay the same graph in turn and the second replay would overwrite the first one's
  outputs. All pieces' graphs share one memory pool (each graph's outputs are cloned before the
  next replay, so their intermediates may overlap). Its tests are marked ``gpu``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx


def has_standalone_compile() -> bool:
    """Whether this torch offers ``torch._inductor.standalone_compile`` (torch >= 2.8)."""
    try:
        from torch._inductor import standalone_compile  # noqa: F401
    except ImportError:
        return False
    return True


class InductorGraph:
    """One piece compiled by inductor for inputs of the example's shapes, strides and dtypes:
    ``graph(*inputs) -> tuple of tensors`` (the piece's outputs)."""

    name = "inductor"
    shares_graphs = True
    captures_capturable = False  # the CPU experts read their group sizes on the host

    @staticmethod
    def unavailable_reason() -> str | None:
        if has_standalone_compile():
            return None
        return (
            f"graph mode needs torch._inductor.standalone_compile (torch >= 2.8), this is "
            f"{torch.__version__}"
        )

    @classmethod
    def for_piece(
        cls, piece: fx.GraphModule, example_inputs: Sequence[Tensor], is_weight: Sequence[bool]
    ) -> InductorGraph:
        return cls(piece, example_inputs, cpp_wrapper=True)

    def __init__(
        self, piece: fx.GraphModule, example_inputs: Sequence[Tensor], *, cpp_wrapper: bool
    ):
        from torch._inductor import config as inductor_config
        from torch._inductor import standalone_compile

        with inductor_config.patch({"cpp_wrapper": cpp_wrapper, "emulate_precision_casts": True}):
            self._compiled = standalone_compile(
                piece, list(example_inputs), dynamic_shapes="from_example_inputs"
            )

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return tuple(self._compiled(*inputs))


class CUDAGraphPiece:
    """One piece captured as a CUDA graph (CUDA only); ``static_inputs[i]`` True marks an input
    that is the same tensor at every call (a weight), used in place instead of copied.

    Raises:
        RuntimeError: if CUDA is not available.
    """

    name = "cuda_graph"
    shares_graphs = False
    captures_capturable = True  # forward_cuda of the experts reads nothing to the host
    _pool = None  # one memory pool for every captured piece (torch.cuda.graph_pool_handle)

    @staticmethod
    def unavailable_reason() -> str | None:
        return None if torch.cuda.is_available() else "CUDA graphs need a CUDA device"

    @classmethod
    def for_piece(
        cls, piece: fx.GraphModule, example_inputs: Sequence[Tensor], is_weight: Sequence[bool]
    ) -> CUDAGraphPiece:
        return cls(piece, example_inputs, is_weight)

    def __init__(
        self,
        piece: Callable[..., Sequence[Tensor]],
        example_inputs: Sequence[Tensor],
        static_inputs: Sequence[bool] | None = None,
        *,
        num_warmup: int = 2,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAGraphPiece needs a CUDA device")
        static = static_inputs or [False] * len(example_inputs)
        self._inputs = [t if s else t.clone() for t, s in zip(example_inputs, static, strict=True)]
        self._copied = [i for i, s in enumerate(static) if not s]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # documented recipe: warm up on a side stream
            for _ in range(num_warmup):
                piece(*self._inputs)
        torch.cuda.current_stream().wait_stream(stream)
        if CUDAGraphPiece._pool is None:
            CUDAGraphPiece._pool = torch.cuda.graph_pool_handle()
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=CUDAGraphPiece._pool):
            self._outputs = tuple(piece(*self._inputs))

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        for i in self._copied:
            self._inputs[i].copy_(inputs[i])
        self._graph.replay()
        return tuple(t.clone() for t in self._outputs)
