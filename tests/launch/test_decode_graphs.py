"""FULL_AND_PIECEWISE's whole decode graphs (``launch.engine.decode_graphs``), checked on the CPU
with a recording stand-in for CUDA-graph capture: which buckets are captured and replayed, the
persistent buffers (the same tensors every step, the padding requests' values), the output
returned without a clone, greedy tokens equal to eager; DBO ubatches and mixed steps do not
replay them. On a GPU (marked ``gpu``): real CUDA graphs equal eager.

The stand-in's capture runs the forward once and keeps its output tensor; its replay runs the
forward again on the buffers' current contents and writes the result into that same tensor, as a
graph replay overwrites its captured output. (A real graph also freezes the Python values the
forward read at capture; the bucket metadata's are fixed for that reason, and the GPU test
checks the real thing.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.single_rank import single_rank_engine

SIZES = (1, 2, 4, 8)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class RecordingCapture:
    """``capture_whole`` on the CPU: records the captured and replayed buckets."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[int] = []
        self.outputs: dict[int, torch.Tensor] = {}

    def capture_whole(self, forward):
        output = forward()
        bucket = output.shape[0]
        self.captured.append(bucket)
        self.outputs[bucket] = output

        def replay():
            output.copy_(forward())
            self.replayed.append(bucket)
            return output

        return replay


def _greedy(engine, prompts, first_id=0, max_tokens=4):
    from launch.engine.request import Request, SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(
            Request(
                request_id=first_id + i,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=max_tokens),
            )
        )
    return {r.request_id - first_id: r.output_token_ids for r in engine.run_until_done()}


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir):
    return single_rank_engine(tiny_mixtral_dir, enforce_eager=True)


def _with_decode_graphs(engine, sizes=SIZES):
    """Swap the engine's model for a (piecewise-uncaptured) GraphModeModel whose decode-only
    forwards replay whole graphs captured by a ``RecordingCapture``."""
    from launch.engine.decode_graphs import DecodeGraphs
    from moe.compilation import GraphModeModel

    recorder = RecordingCapture()
    graphs = DecodeGraphs(
        engine.model,
        sizes,
        capture_whole=recorder.capture_whole,
        max_num_blocks_per_req=engine.max_num_blocks_per_req,
        block_size=engine.args.block_size,
        device=torch.device("cpu"),
        pin_memory=False,
    )
    graphs.capture()
    model = GraphModeModel(engine.model, sizes)  # pieces not captured: other forwards are eager
    model.set_whole_forward(graphs)
    engine.model_runner.model = model
    return graphs, recorder


def test_decode_steps_replay_whole_graphs_on_persistent_buffers_equal_to_eager(engine):
    eager_model = engine.model_runner.model
    want = _greedy(engine, PROMPTS)
    graphs, recorder = _with_decode_graphs(engine)
    try:
        assert recorder.captured == [8, 4, 2, 1]  # the largest first
        pointers = {name: t.data_ptr() for name, t in graphs.buffers.items()}
        got = _greedy(engine, PROMPTS, first_id=100)
        assert got == want
        # 3 decode steps of 3 requests (bucket 4); the prefill and no other step replayed
        assert recorder.replayed == [4, 4, 4]
        assert {name: t.data_ptr() for name, t in graphs.buffers.items()} == pointers
        # the last step: 3 requests, then one padding request (one row, seq_len 1, no KV write)
        buffers = graphs.buffers
        assert buffers["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
        assert buffers["seq_lens"][3].item() == 1 and buffers["slot_mapping"][3].item() == -1
        assert not buffers["block_table"][3].any()
        assert (buffers["seq_lens"][:3] > 3).all()  # the real requests' contexts
    finally:
        engine.model_runner.model = eager_model


def test_a_replay_returns_the_graphs_output_without_a_clone(engine, monkeypatch):
    from dbo.forward_context import ForwardContext
    from moe.compilation import backends
    from moe.layers.attention_metadata import CommonAttentionMetadata

    eager_model = engine.model_runner.model
    graphs, recorder = _with_decode_graphs(engine)
    try:
        # two one-token requests at positions 3 and 5 (blocks 0 and 1 of a block size of 4)
        metadata = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            seq_lens=torch.tensor([4, 6], dtype=torch.int32),
            block_table=torch.tensor(
                np.array([[0] + [0] * 15, [1, 2] + [0] * 14]), dtype=torch.int32
            ),
            slot_mapping=torch.tensor([3, 9], dtype=torch.int64),
            num_reqs=2,
            num_actual_tokens=2,
            num_tokens=2,
            max_query_len=1,
            max_seq_len=6,
        )
        ids, pos = torch.tensor([7, 8]), torch.tensor([3, 5])
        model = engine.model_runner.model
        with torch.inference_mode():
            out = model(ids, pos, metadata)
            assert recorder.replayed == [2]
            assert out.data_ptr() == recorder.outputs[2].data_ptr()  # a view, not a copy
            # inside a DBO ubatch, and for a step with a prefill, the whole graphs stand aside
            with monkeypatch.context() as patch:
                ubatch = ForwardContext(attn_metadata=metadata, ubatch_id=0)
                patch.setattr(backends, "current_forward_context", lambda: ubatch)
                assert graphs.bucket_for(2, metadata) is None
            assert graphs.bucket_for(2, metadata) == 2
            prefill = CommonAttentionMetadata.for_requests([(0, 3)], block_size=4)[0]
            assert graphs.bucket_for(3, prefill) is None
            assert graphs.bucket_for(9, metadata) is None  # above the largest bucket
    finally:
        engine.model_runner.model = eager_model


def test_step_inputs_go_through_persistent_device_buffers(engine):
    """input_ids / positions / logits_indices: views of the same buffers at every step."""
    batch = engine.model_runner.input_batch
    staged = batch._staged
    pointers = {name: s.buffer.data_ptr() for name, s in staged.items()}
    seen = []
    prepare = batch.prepare_inputs

    def recording(scheduler_output, *, num_rows):
        inputs = prepare(scheduler_output, num_rows=num_rows)
        seen.append((inputs.input_ids.data_ptr(), inputs.positions.data_ptr()))
        return inputs

    batch.prepare_inputs = recording
    try:
        _greedy(engine, PROMPTS[:2], first_id=200, max_tokens=3)
    finally:
        del batch.prepare_inputs
    assert len(seen) == 3 and len(set(seen)) == 1
    assert seen[0] == (pointers["input_ids"], pointers["positions"])
    assert {name: s.buffer.data_ptr() for name, s in staged.items()} == pointers


def test_a_staged_buffer_grows_when_a_step_needs_more_rows():
    from launch.engine.input_batch import StagedBuffer

    buffer = StagedBuffer(2, torch.int64, torch.device("cpu"), pin_memory=False)
    assert buffer.upload(np.array([4, 5])).tolist() == [4, 5]
    out = buffer.upload(np.array([1, 2, 3]))
    assert out.tolist() == [1, 2, 3] and buffer.buffer.shape[0] == 4


def test_whole_graphs_need_a_capturing_backend_and_attention_and_no_ep(monkeypatch):
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.graph_mode import whole_graph_unavailable_reason
    from moe.compilation.backends import CUDAGraphPiece, InductorGraph
    from moe.platforms import CudaPlatform, set_current_platform

    monkeypatch.delenv("MOE_DBO_GRAPH_MODE", raising=False)
    cuda = CudaPlatform()
    set_current_platform(cuda)
    try:
        args = EngineArgs(attention_backend="TORCH_SDPA")
        assert args.cudagraph_mode == "FULL_AND_PIECEWISE"
        assert "TORCH_SDPA plans on the host" in whole_graph_unavailable_reason(
            args, CUDAGraphPiece, cuda
        )
        full = EngineArgs(attention_backend="TORCH_SDPA")
        object.__setattr__(full, "attention_backend", "TRITON_ATTN")  # the capturable backend
        assert whole_graph_unavailable_reason(full, CUDAGraphPiece, cuda) is None
        assert "captures pieces only" in whole_graph_unavailable_reason(full, InductorGraph, cuda)
        object.__setattr__(full, "enable_expert_parallel", True)
        assert "expert parallelism" in whole_graph_unavailable_reason(full, CUDAGraphPiece, cuda)
        piecewise = EngineArgs(cudagraph_mode="PIECEWISE", attention_backend="TORCH_SDPA")
        assert whole_graph_unavailable_reason(piecewise, CUDAGraphPiece, cuda) == (
            "cudagraph_mode PIECEWISE"
        )
    finally:
        set_current_platform(None)


def test_piece_outputs_are_cloned_only_inside_a_dbo_ubatch(monkeypatch):
    """``CUDAGraphPiece`` clones its outputs where ``in_ubatch()``: a ubatch's forward context."""
    from dbo.forward_context import ForwardContext, set_forward_context
    from moe.compilation import backends

    assert not backends.in_ubatch()
    with set_forward_context(ForwardContext()):
        assert not backends.in_ubatch()
    ubatch = ForwardContext(ubatch_id=1)  # as a ubatch thread's (set there by UBatchWrapper)
    monkeypatch.setattr(backends, "current_forward_context", lambda: ubatch)
    assert backends.in_ubatch()


def _cuda_engine(model_dir, device, attention_backend, **overrides):
    from distributed import single_process_groups
    from launch.engine.arg_utils import EngineArgs
    from launch.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model_dir,
        dtype="float32",
        max_model_len=64,
        block_size=4,
        attention_backend=attention_backend,
        **overrides,
    )
    groups = single_process_groups(timeout_s=60, device=device)
    return LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)


@pytest.mark.gpu
@NEEDS_CUDA
def test_whole_decode_graphs_equal_eager_on_cuda(tiny_mixtral_dir):
    """FULL_AND_PIECEWISE on a GPU with the platform's whole-graph attention backend: decode
    steps replay real CUDA graphs, greedy tokens equal eager's."""
    from launch.engine.decode_graphs import DecodeGraphs
    from moe.layers.attention_backend import AttentionBackendEnum
    from moe.platforms import current_platform
    from tests.helpers.gpu import device_platform

    with device_platform():
        backends = [
            b
            for b in current_platform().full_graph_attention_backends
            if b in AttentionBackendEnum.__members__
        ]
        if not backends:
            pytest.skip("no attention backend here is captured whole on CUDA")
        device = torch.device("cuda", 0)
        eager_engine = _cuda_engine(tiny_mixtral_dir, device, backends[0], enforce_eager=True)
        eager = _greedy(eager_engine, PROMPTS)
        graphs_engine = _cuda_engine(
            tiny_mixtral_dir, device, backends[0], cudagraph_capture_sizes=(1, 2, 4, 8)
        )
        assert graphs_engine.graph_stats.num_whole_graphs == 4
        whole = graphs_engine.model_runner.model._whole
        assert isinstance(whole, DecodeGraphs)
        assert _greedy(graphs_engine, PROMPTS) == eager


class _EagerPiecesRecordingWhole:
    """A graph backend that runs each piece's FX module as traced and records whole captures:
    what FULL_AND_PIECEWISE builds at start-up on CUDA, checked on the CPU."""

    name = "eager_pieces"
    shares_graphs = False
    captures_capturable = False  # the CPU experts read their group sizes on the host
    captures_whole = True
    recorder = RecordingCapture()

    @staticmethod
    def unavailable_reason():
        return None

    @classmethod
    def for_piece(cls, piece, example_inputs, is_weight):
        return lambda *inputs: tuple(piece(*inputs))

    @classmethod
    def capture_whole(cls, forward):
        return cls.recorder.capture_whole(forward)


def test_an_engine_with_full_and_piecewise_captures_decode_steps_whole(
    tiny_mixtral_dir, engine, monkeypatch
):
    """Start-up through ``build_graph_mode`` on a platform whose backend captures whole
    forwards and whose attention backend reads no host values (stand-ins on the CPU): every
    bucket captured whole, decode steps replay them, prefills run the pieces, tokens equal."""
    from moe.platforms import CpuPlatform, set_current_platform

    class WholeGraphPlatform(CpuPlatform):
        graph_modes = ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE")
        full_graph_attention_backends = ("CPU_ATTN",)

        def graph_backend(self):
            return _EagerPiecesRecordingWhole

    want = _greedy(engine, PROMPTS, first_id=300)
    monkeypatch.delenv("MOE_DBO_GRAPH_MODE", raising=False)
    recorder = _EagerPiecesRecordingWhole.recorder = RecordingCapture()
    set_current_platform(WholeGraphPlatform())
    try:
        graphs_engine = single_rank_engine(
            tiny_mixtral_dir, cudagraph_capture_sizes=(1, 2, 4), attention_backend="CPU_ATTN"
        )
        assert graphs_engine.args.cudagraph_mode == "FULL_AND_PIECEWISE"
        assert graphs_engine.graph_stats.num_whole_graphs == 3
        assert recorder.captured == [4, 2, 1]
        assert _greedy(graphs_engine, PROMPTS) == want
    finally:
        set_current_platform(None)
    assert recorder.replayed == [4, 4, 4]


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_whole_capture_replays_on_its_buffers_and_pieces_return_their_outputs():
    """``capture_whole``: a replay reads the buffers' current values into the same output
    tensor; a piece outside a ubatch returns its captured outputs themselves (no clone)."""
    from moe.compilation.backends import CUDAGraphPiece

    buffer = torch.arange(8.0, device="cuda")
    replay = CUDAGraphPiece.capture_whole(lambda: buffer * 2 + 1)
    first = replay()
    buffer.copy_(torch.full((8,), 3.0))
    second = replay()
    assert second.data_ptr() == first.data_ptr()
    assert second.tolist() == [7.0] * 8
    x = torch.ones(4, device="cuda")
    piece = CUDAGraphPiece(lambda a: (a + 1,), [x])
    (out1,) = piece(torch.full((4,), 2.0, device="cuda"))
    assert out1.tolist() == [3.0] * 4
    (out2,) = piece(torch.full((4,), 5.0, device="cuda"))
    assert out2.data_ptr() == out1.data_ptr() and out2.tolist() == [6.0] * 4
