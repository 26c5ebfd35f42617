"""Graph backends for one graph-mode piece at one bucket size: ``InductorGraph`` (CPU) and
``CUDAGraphPiece`` (CUDA); the platform hands out the class (``Platform.graph_backend()``). What
each offers and why (shared graphs, cloned outputs under DBO): docs/hardware.md, "Graph backends:
inductor and CUDA graphs"."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx

from dbo.forward_context import current_forward_context


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
    captures_whole = False  # the CPU attention plans read the metadata on the host

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
    captures_whole = True
    _pool = None  # one memory pool for every captured graph (torch.cuda.graph_pool_handle)

    @staticmethod
    def unavailable_reason() -> str | None:
        return None if torch.cuda.is_available() else "CUDA graphs need a CUDA device"

    @classmethod
    def for_piece(
        cls, piece: fx.GraphModule, example_inputs: Sequence[Tensor], is_weight: Sequence[bool]
    ) -> CUDAGraphPiece:
        return cls(piece, example_inputs, is_weight)

    @classmethod
    def capture_whole(cls, forward: Callable[[], Tensor]) -> Callable[[], Tensor]:
        """``forward()`` (a whole model forward reading persistent input buffers) captured as one
        CUDA graph; returns ``replay() -> output``, the same tensor at every replay (not cloned:
        the next replay of any graph of the pool may overwrite it).

        Raises:
            RuntimeError: if CUDA is not available, or ``forward`` does what a capture refuses
                (a host read of a device value, a synchronisation).
        """
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAGraphPiece.capture_whole needs a CUDA device")
        graph, output = _capture(forward, num_warmup=1)

        def replay() -> Tensor:
            graph.replay()
            return output

        return replay

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
        self._graph, outputs = _capture(lambda: tuple(piece(*self._inputs)), num_warmup=num_warmup)
        self._outputs = tuple(outputs)

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        for i in self._copied:
            self._inputs[i].copy_(inputs[i])
        self._graph.replay()
        if in_ubatch():
            return tuple(t.clone() for t in self._outputs)
        return self._outputs


def in_ubatch() -> bool:
    """Whether this thread runs a DBO ubatch (whose graph outputs another ubatch may overwrite)."""
    context = current_forward_context()
    return context is not None and (context.ubatch_id is not None or context.ubatch is not None)


def _capture(fn: Callable[[], object], *, num_warmup: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's output at capture): ``fn`` warmed up on a side stream ``num_warmup`` times
    (the documented recipe), then captured in the pool every graph shares."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(num_warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if CUDAGraphPiece._pool is None:
        CUDAGraphPiece._pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=CUDAGraphPiece._pool):
        output = fn()
    return graph, output
