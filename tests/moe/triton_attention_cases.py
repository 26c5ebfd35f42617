"""Cases of ``test_triton_attention``, run in a subprocess under ``TRITON_INTERPRET=1`` (Triton
reads the variable when it is imported; see ``tests.helpers.triton_interpreter``):
``python -m tests.moe.triton_attention_cases <case> <dtype>... [--device cuda]`` exits 0 when every
check holds (on a GPU the same checks run compiled, without the interpreter).

The TRITON_ATTN paths (``forward_cuda`` of ``PagedAttention`` / ``PagedMLACache`` on the CUDA
platform) against ``forward_native`` on CPU tensors, each writing its own copy of the cache.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from moe.layers.attention import PagedAttention
from moe.layers.attention_backend import AttentionBackendEnum
from moe.layers.attention_metadata import CommonAttentionMetadata
from moe.layers.attention_selector import set_attention_backend
from moe.layers.attention_tuning import MLALayout
from moe.layers.mla import PagedMLACache
from moe.platforms import CudaPlatform, set_current_platform
from tests.helpers.triton_interpreter import fixed_bfloat16_dot

# (tokens already cached, query rows) per request: prefill chunks from 0 and mid-sequence,
# decodes, a request with no query row, contexts on and off block boundaries
MIXED = [(0, 5), (7, 1), (15, 1), (3, 9), (4, 0), (11, 2), (0, 1), (2, 6)]
DECODE = [(15, 1), (0, 1), (8, 1), (31, 1), (4, 0), (16, 1)]
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 4 and 6 (not a power of 2)
GQA_SHAPES = [(4, 4, 64), (8, 2, 128), (6, 1, 64)]
# float64 exact up to summation order; float32, float16 and bfloat16 a few ulps (2^-23, 2^-10,
# 2^-7) of the largest value (the outputs are convex combinations of values)
TOLERANCE = {
    torch.float64: 2**-40,
    torch.float32: 2**-17,
    torch.float16: 2**-8,
    torch.bfloat16: 2**-5,
}


def scrambled_metadata(requests, block_size: int, num_padding: int, seed: int):
    """Metadata of ``requests`` whose blocks are a random permutation of the cache's (so the
    block table is walked, not assumed consecutive), with ``num_padding`` padding rows (slot -1);
    returns it and the number of cache blocks."""
    metadata, num_blocks = CommonAttentionMetadata.for_requests(requests, block_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    block_table = perm[metadata.block_table.long()].int()
    slot_mapping = metadata.slot_mapping
    slots = perm[slot_mapping // block_size] * block_size + slot_mapping % block_size
    slots = torch.cat((slots, torch.full((num_padding,), -1, dtype=torch.long)))
    metadata = CommonAttentionMetadata(
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
        block_table=block_table,
        slot_mapping=slots,
        num_reqs=metadata.num_reqs,
        num_actual_tokens=metadata.num_actual_tokens,
        num_tokens=metadata.num_actual_tokens + num_padding,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
    )
    return metadata, num_blocks


def _assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    bound = TOLERANCE[dtype] * max(1.0, float(ref.abs().max()))
    err = float((out.double() - ref.double()).abs().max())
    if not err <= bound:
        raise AssertionError(f"{name} {dtype}: max error {err:.3g} > {bound:.3g}")
    print(f"{name} {dtype}: max error {err:.3g} <= {bound:.3g}")


def _batches():
    """A mixed batch over blocks of 4 tokens and a decode batch over blocks of 16, both padded;
    returns (name, block_size, metadata, num_blocks) each."""
    yield "mixed", 4, *scrambled_metadata(MIXED, 4, num_padding=3, seed=0)
    yield "decode", 16, *scrambled_metadata(DECODE, 16, num_padding=2, seed=1)


def check_gqa(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    for num_heads, num_kv_heads, head_dim in GQA_SHAPES:
        for batch, block_size, metadata, num_blocks in _batches():
            op = PagedAttention(
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                scale=head_dim**-0.5,
            )
            assert op.forward_path == "forward_cuda"
            assert op.backend is AttentionBackendEnum.TRITON_ATTN
            num_tokens = metadata.num_tokens
            q = torch.randn(num_tokens, num_heads * head_dim, generator=gen).to(device, dtype)
            k, v = (
                torch.randn(num_tokens, num_kv_heads * head_dim, generator=gen).to(device, dtype)
                for _ in range(2)
            )
            cache = torch.randn(op.kv_cache_shape(num_blocks, block_size), generator=gen)
            op.bind_kv_cache(cache.to(device, dtype))
            ref = op.forward_native(q, k, v, metadata)
            ref_cache = op.kv_cache
            op.bind_kv_cache(cache.to(device, dtype))
            out = op(q, k, v, metadata)
            if not torch.equal(op.kv_cache, ref_cache):
                raise AssertionError(f"gqa {batch}: the K/V writes differ")
            if out[metadata.num_actual_tokens :].any():
                raise AssertionError(f"gqa {batch}: padding rows are not zero")
            name = f"gqa {batch} heads {num_heads}/{num_kv_heads}x{head_dim} block {block_size}"
            _assert_close(name, out, ref, dtype)


def check_mla(dtype: torch.dtype, device: torch.device) -> None:
    """DeepSeek's latent widths (kv_lora_rank 512, rope 64): 4 heads (one program per KV head)
    on the mixed batch, 20 heads (split over two programs, the second partial) on the decodes."""
    gen = torch.Generator().manual_seed(1)
    for (batch, block_size, metadata, num_blocks), num_heads in zip(
        _batches(), (4, 20), strict=True
    ):
        layout = MLALayout(num_heads=num_heads, nope=32, rope=64, v=32, kv_lora_rank=512)
        op = PagedMLACache(layout)
        assert op.forward_path == "forward_cuda"
        num_tokens, heads = metadata.num_tokens, layout.num_heads
        q_nope = torch.randn(num_tokens, heads, layout.nope, generator=gen).to(device, dtype)
        q_pe = torch.randn(num_tokens, heads, layout.rope, generator=gen).to(device, dtype)
        kv_c = torch.randn(num_tokens, layout.kv_lora_rank, generator=gen).to(device, dtype)
        k_pe = torch.randn(num_tokens, layout.rope, generator=gen).to(device, dtype)
        w = torch.randn(heads * (layout.nope + layout.v), layout.kv_lora_rank, generator=gen)
        w = (w * layout.kv_lora_rank**-0.5).to(device, dtype)
        cache = torch.randn(op.kv_cache_shape(num_blocks, block_size), generator=gen)
        scale = (layout.nope + layout.rope) ** -0.5
        op.bind_kv_cache(cache.to(device, dtype))
        op.write(kv_c, k_pe, metadata.slot_mapping.to(device))
        ref = op.forward_native(q_nope, q_pe, w, metadata, scale=scale)
        ref_cache = op.kv_cache
        op.bind_kv_cache(cache.to(device, dtype))
        op.write_planned(kv_c, k_pe, metadata)
        out = op(q_nope, q_pe, w, metadata, scale=scale)
        if not torch.equal(op.kv_cache, ref_cache):
            raise AssertionError(f"mla {batch}: the latent writes differ")
        if out[metadata.num_actual_tokens :].any():
            raise AssertionError(f"mla {batch}: padding rows are not zero")
        _assert_close(f"mla {batch} block {block_size}", out, ref, dtype)


def check_models(dtype: torch.dtype, device: torch.device) -> None:
    """Tiny OLMoE (GQA) and DeepSeek-V3 (MLA) models on the CUDA op paths with TRITON_ATTN equal
    the same weights with every op on ``forward_native``: a prefill of two prompts with a padding
    row, then a decode step, each model writing its own caches."""
    import tempfile

    import transformers

    from moe import build_model, init_random_weights, load_config, set_custom_ops
    from tests.conftest import TINY_CONFIGS
    from tests.helpers.attention_metadata import make_paged_metadata

    block_tables = [[5, 2, 9], [11, 0]]
    steps = [
        (torch.arange(3, 14), torch.tensor([*range(7), *range(3), 0]), [7, 3], [7, 3], 1),
        (torch.tensor([20, 21]), torch.tensor([7, 3]), [1, 1], [8, 4], 0),
    ]
    for model_type in ("olmoe", "deepseek_v3"):
        prefix, kwargs = TINY_CONFIGS[model_type]
        with tempfile.TemporaryDirectory() as path:
            getattr(transformers, f"{prefix}Config")(**kwargs).save_pretrained(path)
            config = load_config(path)
        models = []
        for custom_ops in ("none", "all"):
            set_custom_ops(custom_ops)
            model = build_model(config, dtype=dtype, device=device)
            init_random_weights(model, seed=0)
            model.allocate_kv_caches(16, 4)
            models.append(model)
        set_custom_ops("all")
        attention = [m for m in models[1].modules() if hasattr(m, "backend")]
        assert attention and all(m.backend is AttentionBackendEnum.TRITON_ATTN for m in attention)
        with torch.no_grad():
            for step, (input_ids, positions, query_lens, seq_lens, padding) in enumerate(steps):
                metadata = make_paged_metadata(
                    query_lens, seq_lens, block_tables, num_padding=padding
                )
                inputs = (input_ids.to(device), positions.to(device), metadata)
                native, out = (model(*inputs) for model in models)
                _assert_close(f"model {model_type} step {step}", out, native, dtype)


CASES = {"gqa": check_gqa, "mla": check_mla, "models": check_models}


def main(argv: list[str]) -> None:
    device = torch.device("cpu")
    if "--device" in argv:
        at = argv.index("--device")
        device, argv = torch.device(argv[at + 1]), argv[:at] + argv[at + 2 :]
    case, *dtype_names = argv
    set_current_platform(CudaPlatform())  # the ops bind forward_cuda (on CPU tensors too)
    set_attention_backend(None)  # the platform's default: TRITON_ATTN where Triton launches
    fix = fixed_bfloat16_dot() if device.type == "cpu" else contextlib.nullcontext()
    with fix:
        for name in dtype_names:
            CASES[case](getattr(torch, name), device)


if __name__ == "__main__":
    main(sys.argv[1:])
