"""The traced forward and its pieces: ``trace_forward`` (``make_fx``, weights as inputs),
``split_forward`` (cut at the splitting ops), and the structure key that lets pieces of equal
code over other layers' weights share one compiled graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from moe.compilation.splitting import (
    SplittingOp,
    recording_splitting_ops,
    run_splitting_op,
)

SPLITTING_OP = torch.ops.moe_dbo.splitting_op.default


class TracingMetadata:
    """The attention metadata a trace sees: ``num_tokens`` only. Reading anything else raises,
    since the metadata belongs inside a splitting op (a traced read would be baked into a graph)."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens

    def __getattr__(self, name: str):
        raise AttributeError(
            f"graph mode traced a read of attn_metadata.{name} outside a splitting op; pass the "
            f"metadata to moe.compilation.splitting.splitting_op instead"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TracedForward:
    """``graph(*weights, input_ids, positions)``: the forward on ``num_rows`` rows."""

    graph: fx.GraphModule
    weights: tuple[Tensor, ...]  # the parameters and buffers the graph reads, in input order
    ops: tuple[SplittingOp, ...]  # by the index in each splitting-op node


def trace_forward(model: nn.Module, num_rows: int) -> TracedForward:
    """Trace ``model(input_ids [num_rows], positions [num_rows], attn_metadata)`` with
    ``make_fx`` as a function of (its parameters and buffers, input_ids, positions)."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(state)
    meta = TracingMetadata(num_rows)

    def fn(*args: Tensor) -> Tensor:
        values = dict(zip(names, args[: len(names)], strict=True))
        return torch.func.functional_call(model, values, (*args[len(names) :], meta))

    device = next(iter(state.values())).device
    ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
    with recording_splitting_ops() as ops:
        graph = make_fx(fn)(*state.values(), ids, ids.clone())
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    weights = []
    for name, node in zip(names, placeholders, strict=False):
        if node.users:
            weights.append(state[name])
        else:
            graph.graph.erase_node(node)
    graph.graph.lint()
    graph.recompile()
    return TracedForward(graph=graph, weights=tuple(weights), ops=tuple(ops))


def _partitions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Partition of each node: a new one after each splitting op, which sits alone in its own."""
    partition, ids = 0, {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is SPLITTING_OP:
            ids[node] = partition + 1
            partition += 2
        else:
            ids[node] = partition
    return ids


def _fake_to_zeros(val: Tensor) -> Tensor:
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).zero_()


def structure_key(piece: fx.GraphModule, example: list[Tensor]) -> tuple[str, list[Tensor]]:
    """(key, constants): pieces with equal keys and equal constants compute the same function of
    their inputs (the same op sequence on inputs of the same shapes, strides and dtypes)."""
    index: dict[fx.Node, str] = {}
    lines, constants = [], []
    for i, node in enumerate(piece.graph.nodes):
        index[node] = f"%{i}"
        if node.op == "get_attr":
            constants.append(getattr(piece, node.target))
            lines.append(f"get_attr {len(constants) - 1}")
            continue
        target = "" if node.op == "placeholder" else str(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        lines.append(f"{node.op} {target} {args!r}")
    inputs = [(tuple(t.shape), t.stride(), t.dtype, t.device) for t in example]
    consts = [(tuple(t.shape), t.dtype) for t in constants]
    return repr((lines, inputs, consts)), constants


@dataclass(slots=True)
class SplitForward:
    """A traced forward cut at its splitting ops; call ``(input_ids, positions)`` once its pieces
    are compiled (``compile_pieces``)."""

    graph: fx.GraphModule  # top level: calls submod_k (pieces, splitting ops) in order
    weights: tuple[Tensor, ...]
    ops: tuple[SplittingOp, ...]

    def __call__(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.graph.forward(*self.weights, input_ids, positions)

    def _submodules(self) -> list[tuple[fx.Node, fx.GraphModule]]:
        return [
            (n, getattr(self.graph, n.target))
            for n in self.graph.graph.nodes
            if n.op == "call_module"
        ]

    def compile_pieces(
        self,
        compile_piece: Callable[[fx.GraphModule, list[Tensor], list[bool]], object],
        shared: dict[str, list] | None,
    ) -> int:
        """Replace every submodule by a compiled piece or its splitting op's runner; returns the
        number of graphs compiled. ``shared`` (structure key -> [(constants, graph)]) lends
        graphs between pieces of equal structure; None compiles every piece (CUDA graphs)."""
        placeholders = {n: i for i, n in enumerate(self.graph.graph.nodes) if n.op == "placeholder"}
        num_compiled = 0
        for node, sub in self._submodules():
            ops = [
                n for n in sub.graph.nodes if n.op == "call_function" and n.target is SPLITTING_OP
            ]
            if ops:
                runner = _op_runner(sub, ops[0], self.ops)
            else:
                runner, is_new = _compiled_piece(
                    sub, node, placeholders, len(self.weights), self.weights, compile_piece, shared
                )
                num_compiled += is_new
            del self.graph._modules[node.target]
            setattr(self.graph, node.target, runner)
        return num_compiled


def _op_runner(
    sub: fx.GraphModule, op_node: fx.Node, ops: tuple[SplittingOp, ...]
) -> Callable[..., tuple[Tensor]]:
    """The submodule of one splitting op as a call of ``run_splitting_op`` on its inputs."""
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    tensors, op_index = op_node.args[0], op_node.args[1]
    order = [inputs.index(t) for t in tensors]
    op = ops[op_index]

    def run(*args: Tensor) -> tuple[Tensor]:
        return (run_splitting_op(op, *[args[i] for i in order]),)

    return run


def _compiled_piece(
    sub: fx.GraphModule,
    node: fx.Node,
    placeholders: dict[fx.Node, int],
    num_weights: int,
    weights: tuple[Tensor, ...],
    compile_piece: Callable[[fx.GraphModule, list[Tensor], list[bool]], object],
    shared: dict[str, list] | None,
) -> tuple[object, bool]:
    """(graph of one piece, whether it was compiled now rather than lent by an equal piece)."""
    example, is_weight = [], []
    for arg, ph in zip(
        node.args, [n for n in sub.graph.nodes if n.op == "placeholder"], strict=True
    ):
        position = placeholders.get(arg)
        weight = position is not None and position < num_weights
        is_weight.append(weight)
        example.append(weights[position] if weight else _fake_to_zeros(ph.meta["val"]))
    if shared is None:
        return compile_piece(sub, example, is_weight), True
    key, constants = structure_key(sub, example)
    for other_constants, graph in shared.setdefault(key, []):
        if all(torch.equal(a, b) for a, b in zip(constants, other_constants, strict=True)):
            return graph, False
    graph = compile_piece(sub, example, is_weight)
    shared[key].append((constants, graph))
    return graph, True


def split_forward(traced: TracedForward) -> SplitForward:
    """Cut ``traced`` at its splitting ops (``split_module``; every submodule returns a tuple)."""
    ids = _partitions(traced.graph.graph)
    graph = split_module(
        traced.graph, traced.graph, lambda n: ids[n], keep_original_order=True, tuple_return=True
    )
    return SplitForward(graph=graph, weights=traced.weights, ops=traced.ops)
