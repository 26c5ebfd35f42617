"""TRITON_ATTN (``moe.layers.triton_attention``) on CPU tensors in Triton's interpreter: the
kernels equal ``forward_native`` (GQA and MLA, float64, float32, bfloat16; decodes, prefill chunks,
mixed batches, a request with no query row, padding rows, contexts off the block size, GQA ratios
1, 4 and 6, head_dim 64 and 128, MLA's 512 + 64 latent), and the CUDA platform picks the backend
where Triton can launch. The interpreter runs in a subprocess: Triton reads ``TRITON_INTERPRET``
when it is imported (``tests.helpers.triton_interpreter``). Speed and the compiled kernel are a
GPU's to check (``docs/hardware.md``, attention backends)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="TRITON_ATTN needs Triton (not installed)")

import torch  # noqa: E402

from moe import build_model, init_random_weights, load_config  # noqa: E402
from moe.layers import triton_attention, triton_norm  # noqa: E402
from moe.layers.attention_backend import AttentionBackendEnum  # noqa: E402
from moe.layers.attention_metadata import CommonAttentionMetadata  # noqa: E402
from moe.layers.attention_selector import set_attention_backend  # noqa: E402
from moe.platforms import CpuPlatform, CudaPlatform, set_current_platform, triton_probe  # noqa: E402
from tests.helpers.op_count import CountOps  # noqa: E402
from tests.helpers.triton_interpreter import compile_for_sm90, run_interpreted  # noqa: E402

CASES = "tests.moe.triton_attention_cases"


DTYPES = ("float64", "float32", "bfloat16")


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_kernel_equals_forward_native(case):
    output = run_interpreted(CASES, case, *DTYPES, timeout_s=600)
    for dtype in DTYPES:  # every check ran and printed its error bound
        assert f"{case} mixed" in output and f"{case} decode" in output and dtype in output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["gqa", "mla", "models"])
def test_compiled_kernels_equal_forward_native_on_a_gpu(case):
    """The same checks on CUDA tensors, the kernels compiled (float16 too on a GPU)."""
    dtypes = ("float32", "bfloat16") if case == "models" else (*DTYPES, "float16")
    output = run_interpreted(CASES, case, *dtypes, "--device", "cuda", timeout_s=600, env={})
    assert "step 1" in output if case == "models" else f"{case} decode" in output


def test_models_with_triton_attention_equal_forward_native():
    """Tiny OLMoE and DeepSeek-V3 (MLA) on the CUDA op paths with TRITON_ATTN, a prefill with a
    padding row then a decode step, against every op's ``forward_native``."""
    output = run_interpreted(CASES, "models", "float64", "float32", timeout_s=600)
    for model_type in ("olmoe", "deepseek_v3"):
        assert f"model {model_type} step 1 torch.float32" in output


def test_cuda_platform_lists_triton_first_where_it_launches(monkeypatch):
    monkeypatch.setattr(triton_probe, "triton_unavailable_reason", lambda: None)
    assert CudaPlatform().attention_backends[0] == "TRITON_ATTN"
    assert "TRITON_ATTN" not in CpuPlatform().attention_backends
    reason = "no CUDA device (and Triton's interpreter is off)"
    monkeypatch.setattr(triton_probe, "triton_unavailable_reason", lambda: reason)
    assert CudaPlatform().attention_backends == ("TORCH_SDPA", "FLEX_ATTENTION")


# OLMoE's shape at a small scale: 4 layers, hidden 256, 32 experts top-4, 8 heads of 32
OLMOE_SHAPED = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    num_experts=32,
    num_experts_per_tok=4,
    max_position_embeddings=512,
)
CONTEXT_LEN = 256
BLOCK_SIZE = 16


def _decode_ops_per_layer(model, num_reqs: int, counter: CountOps) -> float:
    """The ops (ATen ops + Triton launches) of one decode forward of ``num_reqs`` requests at
    ``CONTEXT_LEN``, over the number of layers."""
    metadata, num_blocks = CommonAttentionMetadata.for_requests(
        [(CONTEXT_LEN - 1, 1)] * num_reqs, BLOCK_SIZE
    )
    model.allocate_kv_caches(num_blocks, BLOCK_SIZE)
    input_ids = torch.arange(num_reqs) % OLMOE_SHAPED["vocab_size"]
    positions = torch.full((num_reqs,), CONTEXT_LEN - 1)
    with torch.no_grad():
        model(input_ids, positions, metadata)  # warm-up: once-per-process probes
        metadata, _ = CommonAttentionMetadata.for_requests(  # a new step's metadata
            [(CONTEXT_LEN - 1, 1)] * num_reqs, BLOCK_SIZE
        )
        counter.ops.clear()
        with counter:
            model(input_ids, positions, metadata)
    return len(counter.ops) / OLMOE_SHAPED["num_hidden_layers"]


def test_decode_ops_per_layer_do_not_grow_with_the_batch(tmp_path, monkeypatch):
    """One decode forward on the CUDA op paths (CPU tensors) with TRITON_ATTN and Triton's
    RMSNorm: at batch 256 at most 1.1x the ops per layer of batch 8 (the whole forward over the
    layers: norms, RoPE, projections, attention, MoE), and at most 60 per layer (issue 52); the
    attention core two launches (KV write, attention) and its zeroed output, each RMSNorm one
    launch and its output's allocation. A Triton launch counts as one op; the kernels are not run
    here (their values are ``test_kernel_equals_forward_native``'s and ``test_triton_norm``'s;
    nothing on this path reads a value on the host, so the ops do not depend on them).
    Measured: 46.75 ops per layer at both batch sizes: MoE 20, RoPE 9, the norms 8 (+ the final
    norm's 2 over 4 layers), the q/k/v/o projections 4, attention 3, residual adds 2, the
    embedding 1 over 4 layers (before Triton's RMSNorm and RoPE's table path: 77.75; TORCH_SDPA
    then: 93.25 and 158)."""
    transformers = pytest.importorskip("transformers")
    transformers.OlmoeConfig(**OLMOE_SHAPED).save_pretrained(tmp_path)
    counter = CountOps()

    def counted_launch(kernel, grid, **kwargs):
        counter.ops.append(f"triton:{kernel.__name__}")

    monkeypatch.setattr(triton_attention, "launch", counted_launch)
    monkeypatch.setattr(triton_attention, "launches_on", lambda device: True)  # counted, not run
    # the RMSNorms launch as where Triton can (the attention backend is set below)
    monkeypatch.setattr(triton_norm, "can_launch_rms_norm", lambda x, weight: True)
    set_current_platform(CudaPlatform())
    set_attention_backend(AttentionBackendEnum.TRITON_ATTN)
    try:
        model = build_model(load_config(tmp_path), dtype=torch.float32)
        init_random_weights(model, seed=0)
        per_layer = {n: _decode_ops_per_layer(model, n, counter) for n in (8, 256)}
    finally:
        set_current_platform(None)
    num_layers = OLMOE_SHAPED["num_hidden_layers"]
    launches = [op for op in counter.ops if op.startswith("triton:")]
    norms = launches.count("triton:rms_norm_kernel")
    assert norms == 4 * num_layers + 1  # input, post-attention, q and k norms; the final one
    assert len(launches) - norms == 2 * num_layers  # KV write + attention
    assert per_layer[256] <= 1.1 * per_layer[8], per_layer
    assert per_layer[8] <= 60 and per_layer[256] <= 60, per_layer
    aten_ops = [op for op in counter.ops if op.startswith("aten::")]
    assert not any("attention" in op or op == "aten::nonzero" for op in aten_ops)  # no SDPA


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3"])
def test_model_forward_reads_nothing_on_the_host(tmp_path, monkeypatch, model_type):
    """With TRITON_ATTN a forward on the CUDA op paths reads no value on the host, the first one on
    a new (u)batch's metadata included (no attention plan, no KV write slots read): GQA and MLA.
    Launches are stubbed (what a launch reads is the device's)."""
    transformers = pytest.importorskip("transformers")
    from tests.conftest import TINY_CONFIGS
    from tests.helpers.attention_metadata import make_paged_metadata
    from tests.helpers.host_reads import recording_host_reads

    prefix, kwargs = TINY_CONFIGS[model_type]
    getattr(transformers, f"{prefix}Config")(**kwargs).save_pretrained(tmp_path)
    monkeypatch.setattr(triton_attention, "launch", lambda kernel, grid, **kw: None)
    monkeypatch.setattr(triton_attention, "launches_on", lambda device: True)
    set_current_platform(CudaPlatform())
    set_attention_backend(AttentionBackendEnum.TRITON_ATTN)
    try:
        model = build_model(load_config(tmp_path), dtype=torch.float32)
        init_random_weights(model, seed=0)
        model.allocate_kv_caches(16, 4)
        steps = [  # a prefill of two prompts with a padding row, then a decode step
            (torch.arange(3, 14), torch.tensor([*range(7), *range(3), 0]), [7, 3], [7, 3], 1),
            (torch.tensor([20, 21]), torch.tensor([7, 3]), [1, 1], [8, 4], 0),
        ]
        with torch.no_grad():
            model(*steps[1][:2], make_paged_metadata([1, 1], [8, 4], [[5, 2, 9], [11, 0]]))
            for input_ids, positions, query_lens, seq_lens, num_padding in steps:
                metadata = make_paged_metadata(
                    query_lens, seq_lens, [[5, 2, 9], [11, 0]], num_padding=num_padding
                )
                with recording_host_reads() as reads:
                    model(input_ids, positions, metadata)
                assert reads == []
    finally:
        set_current_platform(None)


@pytest.mark.parametrize(
    ("case", "dtype"),
    [("gqa", torch.bfloat16), ("gqa", torch.float64), ("mla", torch.bfloat16)],
)
def test_kernels_compile_for_sm90(monkeypatch, case, dtype):
    """What TRITON_ATTN would launch on a Hopper GPU compiles for sm90 (Triton's NVIDIA backend:
    TTIR, TTGIR, LLVM, PTX, ptxas), without a GPU: the launcher's own arguments for a GQA layer
    (head_dim 128, 4 query heads per KV head) and an MLA layer (DeepSeek's 128 heads over the
    512 + 64 latent)."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    from triton import knobs

    if knobs.runtime.interpret:
        pytest.skip("Triton was imported under TRITON_INTERPRET=1: its kernels are interpreted")
    compiled: list[str] = []
    monkeypatch.setattr(triton_attention, "launch", compile_for_sm90(compiled))
    metadata, num_blocks = CommonAttentionMetadata.for_requests([(0, 5), (7, 1)], 16)
    num_tokens = metadata.num_tokens
    if case == "gqa":
        query = torch.zeros(num_tokens, 8, 128, dtype=dtype)
        kv_cache = torch.zeros(2, num_blocks, 16, 2, 128, dtype=dtype)
        triton_attention.triton_write_kv_cache(query[:, :2], query[:, :2], kv_cache, metadata)
        triton_attention.triton_paged_attention(query, kv_cache, metadata, scale=0.1)
    else:
        q_nope = torch.zeros(num_tokens, 128, 128, dtype=dtype)
        q_pe = torch.zeros(num_tokens, 128, 64, dtype=dtype)
        kv_c, k_pe = torch.zeros(num_tokens, 512, dtype=dtype), q_pe[:, 0]
        w = torch.zeros(128 * 256, 512, dtype=dtype)
        kv_cache = torch.zeros(num_blocks, 16, 576, dtype=dtype)
        triton_attention.triton_write_mla_cache(kv_c, k_pe, kv_cache, metadata)
        triton_attention.triton_mla_attention(
            q_nope, q_pe, w, kv_cache, metadata, kv_lora_rank=512, scale=0.1
        )
    assert compiled == ["cache_write_kernel", "paged_attention_kernel"]
