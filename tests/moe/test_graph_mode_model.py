"""GraphModeModel in one process, float64: equals the eager model, pads without touching the KV
cache, keeps the MoE kernel (and every DBO yield in it) out of the compiled pieces.

Tolerance: RMSNorm computes its statistics in float32 by design (as transformers), so even a
float64 model carries float32 roundings there, and the compiled rsqrt/mean round differently from
eager's (measured: 1-2 float32 ulps of the norm's output). Bound: 16 float32 ulps of the largest
compared value; everything else runs in float64.
"""

from __future__ import annotations

import pytest
import torch

from moe import build_model, load_checkpoint, load_config, set_custom_ops
from moe.compilation import GraphModeModel
from moe.fused_moe.modular_kernel import FusedMoEModularKernel
from moe.layers.attention_metadata import CommonAttentionMetadata

BLOCK_SIZE = 4


def _close(got, want):
    atol = 16 * torch.finfo(torch.float32).eps * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _metadata(query_lens, seq_lens, num_padding):
    qsl, slots, tables = [0], [], []
    next_block = 0
    for q, s in zip(query_lens, seq_lens, strict=True):
        blocks = list(range(next_block, next_block + -(-s // BLOCK_SIZE)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (8 - len(blocks)))
        qsl.append(qsl[-1] + q)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s - q, s)]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        num_reqs=len(query_lens),
        num_actual_tokens=qsl[-1],
        num_tokens=qsl[-1] + num_padding,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def _count_kernel_calls(monkeypatch) -> list:
    """A list that gets one entry per ``FusedMoEModularKernel.forward`` call from now on."""
    calls: list = []
    original = FusedMoEModularKernel.forward
    monkeypatch.setattr(
        FusedMoEModularKernel,
        "forward",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    return calls


def _model(path):
    set_custom_ops("all,-experts")  # torch._grouped_mm has no float64: the experts' reference loop
    try:
        model = build_model(load_config(path), dtype=torch.float64)
    finally:
        set_custom_ops("all")
    load_checkpoint(model, path)
    caches = model.allocate_kv_caches(32, BLOCK_SIZE, dtype=torch.float64)
    return model, caches


@pytest.mark.slow
def test_graph_mode_equals_eager_in_float64(tiny_mixtral_dir, monkeypatch):
    eager, eager_caches = _model(tiny_mixtral_dir)
    graph_lm, graph_caches = _model(tiny_mixtral_dir)
    graph = GraphModeModel(graph_lm, (16,))
    calls = _count_kernel_calls(monkeypatch)
    stats = graph.capture(progress=False)
    # layer 0's input piece (embedding), attention-out (both layers), attention-in (layer 1), final
    assert calls == [] and stats.num_graphs == 4
    gen = torch.Generator().manual_seed(0)
    # prefill 7 + 3 tokens and 2 padding rows of the runner: 12 rows, bucket 16 pads 4 more
    meta = _metadata([7, 3], [7, 3], num_padding=2)
    ids = torch.randint(3, 128, (12,), generator=gen)
    pos = torch.tensor([*range(7), *range(3), 0, 0])
    with torch.inference_mode():
        want = eager(ids, pos, meta)
        calls.clear()
        got = graph(ids, pos, meta)
    assert len(calls) == len(graph_lm.model.layers)  # the MoE kernel ran eagerly, once per layer
    _close(got[:10], want[:10])
    for g, e in zip(graph_caches, eager_caches, strict=True):
        _close(g, e)  # the same slots written, padding rows wrote nothing
        assert torch.equal(g != 0, e != 0)
    # decode 2 tokens, then a batch above the largest bucket runs the eager model
    meta = _metadata([1, 1], [8, 4], num_padding=0)
    ids, pos = torch.randint(3, 128, (2,), generator=gen), torch.tensor([7, 3])
    with torch.inference_mode():
        _close(graph(ids, pos, meta), eager(ids, pos, meta))
        meta = _metadata([17], [17], num_padding=0)
        ids, pos = torch.randint(3, 128, (17,), generator=gen), torch.arange(17)
        torch.testing.assert_close(graph(ids, pos, meta), eager(ids, pos, meta), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe"])
def test_graph_mode_equals_eager_mla_dense_and_shared_experts(tiny_arch_dirs, model_type):
    """MLA (its core a splitting op), dense layers and shared experts: prefill then decode."""
    path = tiny_arch_dirs[model_type]
    eager, eager_caches = _model(path)
    graph_lm, graph_caches = _model(path)
    graph = GraphModeModel(graph_lm, (4, 16))
    graph.capture(progress=False)
    gen = torch.Generator().manual_seed(0)
    meta = _metadata([7, 3], [7, 3], num_padding=0)
    ids = torch.randint(3, 128, (10,), generator=gen)
    pos = torch.tensor([*range(7), *range(3)])
    with torch.inference_mode():
        _close(graph(ids, pos, meta), eager(ids, pos, meta))
        meta = _metadata([1, 1], [8, 4], num_padding=0)
        ids, pos = torch.randint(3, 128, (2,), generator=gen), torch.tensor([7, 3])
        _close(graph(ids, pos, meta), eager(ids, pos, meta))
    for g, e in zip(graph_caches, eager_caches, strict=True):
        _close(g, e)


def test_graph_mode_timeline_names_attention_cores_and_pieces_per_layer(tiny_mixtral_dir):
    from dbo.timeline.recorder import TimelineRecorder, set_timeline_recorder

    graph_lm, _ = _model(tiny_mixtral_dir)
    graph = GraphModeModel(graph_lm, (4,))
    graph.capture(progress=False)
    recorder = TimelineRecorder(rank=0)
    set_timeline_recorder(recorder)
    try:
        with torch.inference_mode():
            graph(torch.tensor([5, 6]), torch.tensor([3, 2]), _metadata([1, 1], [4, 3], 0))
    finally:
        set_timeline_recorder(None)
    names = [s.name for s in recorder.spans()]
    # pieces are named after the layer of the splitting op before them: none before layer 0's
    # input piece; each layer's attention-out piece and the piece after its MoE kernel
    assert [names.count(f"{p}graph") for p in ("", "layer0.", "layer1.")] == [1, 2, 2]
    assert names.count("layer0.attention") == names.count("layer1.attention") == 1


def test_a_metadata_read_outside_a_splitting_op_is_refused():
    from moe.compilation.pieces import trace_forward

    class ReadsSlots(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids, positions, attn_metadata):
            return input_ids[: attn_metadata.num_actual_tokens] * self.weight

    with pytest.raises(AttributeError, match=r"attn_metadata\.num_actual_tokens outside a split"):
        trace_forward(ReadsSlots(), 4)


def test_compilation_holds_no_model_code():
    from tests.helpers.distributed import REPO

    for path in (REPO / "moe" / "compilation").glob("*.py"):
        text = path.read_text()
        for name in ("self_attn", "_shared_experts", "kernel.forward", "moe.models", "moe.layers"):
            assert name not in text, (path.name, name)


class _EagerPieces:
    """A graph backend that runs each piece's FX module as it is and captures ``capturable``
    calls, as CUDA graphs do: the split a CUDA-graph capture gets, checked on the CPU."""

    name = "eager_pieces"
    shares_graphs = False
    captures_capturable = True

    @staticmethod
    def unavailable_reason():
        return None

    @classmethod
    def for_piece(cls, piece, example_inputs, is_weight):
        return lambda *inputs: tuple(piece(*inputs))


def test_a_backend_that_captures_communication_free_moe_splits_only_at_attention(
    tiny_mixtral_dir, monkeypatch
):
    """Without expert parallelism the MoE kernel moves nothing: a backend that captures such
    calls (CUDA graphs) gets it inside its pieces, on the experts' device path (``forward_cuda``,
    run here on CPU tensors), one piece per layer instead of two, equal to eager."""
    from moe.platforms import CudaPlatform, set_current_platform

    set_current_platform(CudaPlatform())  # the ops bind their CUDA paths (pure torch)
    try:
        # bfloat16: torch's fake _grouped_mm (the trace) takes bfloat16 only, as CUDA's does
        model = build_model(load_config(tiny_mixtral_dir), dtype=torch.bfloat16)
    finally:
        set_current_platform(None)
    load_checkpoint(model, tiny_mixtral_dir)
    assert model.model.layers[0].block_sparse_moe.experts.forward_path == "forward_cuda"
    model.allocate_kv_caches(32, BLOCK_SIZE, dtype=torch.bfloat16)
    graph = GraphModeModel(model, (8,), backend=_EagerPieces)
    calls = _count_kernel_calls(monkeypatch)
    stats = graph.capture(progress=False)
    # the traces ran the kernel (inlined); layer 0's input piece, the piece between the two
    # attention cores (attention-out, MoE, attention-in) and the last (attention-out, MoE, norm)
    assert calls and stats.num_graphs == 3
    split_ops = graph._forwards[8]
    assert len([n for n in split_ops.graph.graph.nodes if n.op == "call_module"]) == 5
    calls.clear()
    ids, pos = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 1, 2, 0, 1])
    meta = _metadata([3, 2], [3, 2], 0)
    out = graph(ids, pos, meta)
    assert calls == []  # the kernel runs as the traced ops of the pieces, not as a call
    model.allocate_kv_caches(32, BLOCK_SIZE, dtype=torch.bfloat16)  # fresh caches for eager
    want = model(ids, pos, _metadata([3, 2], [3, 2], 0))
    # the traced experts run gate and up as two GEMMs (one eagerly): a few bfloat16 roundings
    bound = 2**-5 * float(want.abs().max())
    torch.testing.assert_close(out, want, rtol=0, atol=bound)
