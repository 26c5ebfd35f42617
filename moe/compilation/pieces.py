"""The traced forward and its pieces: ``trace_forward`` (``make_fx``, weights as inputs),
``split_forward`` (cut at the splitting ops), and the structure key that lets pieces of equal
code over other layers' weights share one compiled graph."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from dbo.forward_context import ForwardContext, set_forward_context
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


def trace_forward(
    model: nn.Module, num_rows: int, *, real: bool = False, capture_capturable: bool = False
) -> TracedForward:
    """Trace ``model(input_ids [num_rows], positions [num_rows], attn_metadata)`` with
    ``make_fx`` as a function of (its parameters and buffers, input_ids, positions).

    On fake tensors (``real`` False: one fake mode for the whole trace, several times faster), or
    running the real ops (``real`` True: state the model builds lazily on its first call, like
    RoPE tables, is then built from real values; do this once before fake traces).
    ``capture_capturable``: trace ``capturable`` splitting ops into the graph (see
    ``moe.compilation.splitting``)."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(state)
    meta = TracingMetadata(num_rows)

    def fn(*args: Tensor) -> Tensor:
        values = dict(zip(names, args[: len(names)], strict=True))
        return torch.func.functional_call(model, values, (*args[len(names) :], meta))

    device = next(iter(state.values())).device
    ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
    with (
        recording_splitting_ops(capture_capturable=capture_capturable) as ops,
        set_forward_context(ForwardContext(attn_metadata=meta)),  # the layers name their ops
    ):
        mode = "real" if real else "fake"
        graph = make_fx(fn, tracing_mode=mode, _allow_non_fake_inputs=not real)(
            *state.values(), ids, ids.clone()
        )
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One piece of a split forward: its graph, example inputs for compiling it (the real
    weights, zeros of the traced shapes and strides for the rest), which inputs are weights."""

    name: str
    module: fx.GraphModule
    example: list[Tensor]
    is_weight: list[bool]


@dataclass(slots=True)
class SplitForward:
    """A traced forward cut at its splitting ops: ``graph`` calls ``submod_k`` in order, each a
    splitting op's runner or a piece (``pieces``) until ``bind`` replaces it by its compiled
    graph. Call ``(input_ids, positions)``, both [num_rows] int64 -> [num_rows, hidden_size]."""

    graph: fx.GraphModule
    weights: tuple[Tensor, ...]
    pieces: list[Piece]

    def __call__(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.graph.forward(*self.weights, input_ids, positions)

    def bind(self, name: str, runner: Callable[..., tuple[Tensor, ...]]) -> None:
        """Call ``runner`` instead of submodule ``name`` (a plain attribute: no module call)."""
        del self.graph._modules[name]
        setattr(self.graph, name, runner)


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


def _piece(
    node: fx.Node,
    sub: fx.GraphModule,
    weight_index: dict[fx.Node, int],
    weights: tuple[Tensor, ...],
) -> Piece:
    """The piece ``sub`` that ``node`` calls, with example inputs for compiling it."""
    example, is_weight = [], []
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for arg, placeholder in zip(node.args, inputs, strict=True):
        index = weight_index.get(arg)
        is_weight.append(index is not None)
        example.append(
            weights[index] if index is not None else _fake_to_zeros(placeholder.meta["val"])
        )
    return Piece(name=node.target, module=sub, example=example, is_weight=is_weight)


def _return_tuples(graph: fx.GraphModule) -> None:
    """Make every submodule of ``graph`` (a ``split_module`` result) return a tuple, its caller
    taking item 0 where it returned one value (what newer torch's ``tuple_return=True`` does;
    done here so that every torch the package accepts splits alike)."""
    for node in [n for n in graph.graph.nodes if n.op == "call_module"]:
        sub = getattr(graph, node.target)
        output = next(n for n in sub.graph.nodes if n.op == "output")
        if isinstance(output.args[0], (tuple, list)):
            continue
        output.args = ((output.args[0],),)
        sub.recompile()
        with graph.graph.inserting_after(node):
            item = graph.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(item, delete_user_cb=lambda user, item=item: user is not item)
    graph.recompile()


def split_forward(traced: TracedForward) -> SplitForward:
    """Cut ``traced`` at its splitting ops (``split_module``; every submodule returns a tuple):
    splitting-op submodules are bound to their runners, the others listed as pieces."""
    ids = _partitions(traced.graph.graph)
    graph = split_module(traced.graph, traced.graph, lambda n: ids[n], keep_original_order=True)
    _return_tuples(graph)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    weight_index = {n: i for i, n in enumerate(placeholders[: len(traced.weights)])}
    split = SplitForward(graph=graph, weights=traced.weights, pieces=[])
    for node in [n for n in graph.graph.nodes if n.op == "call_module"]:
        sub = getattr(graph, node.target)
        ops = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is SPLITTING_OP]
        if ops:
            split.bind(node.target, _op_runner(sub, ops[0], traced.ops))
        else:
            split.pieces.append(_piece(node, sub, weight_index, traced.weights))
    return split
