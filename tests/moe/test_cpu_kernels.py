"""Our compiled CPU paged-attention kernel (``moe/kernels/csrc/paged_attention_cpu.cpp``) equals the
per-request reference (``forward_native``), for every ISA build this CPU runs (AVX2, AVX-512; see
``tests/helpers/cpu_kernels.py``): exactly up to summation order in float64 (the plain C++ loops),
within float32's and bfloat16's precision on the vector paths (head_dim a multiple of the vector
width or not), on batches mixing decode rows and prefill chunks (fresh and mid-sequence), contexts
on and off block boundaries, contexts long enough for the key-transposed score tiles, prefill
chunks long enough for the 4-row tiles and the rows after the last whole tile, GQA ratios, padding
rows, requests cut across ubatches and empty ubatches.

``tests/moe/test_batched_attention.py`` runs the same kinds of batches on the padded SDPA chunks
and on each ISA's kernel. Where no compiler is found the kernel tests skip; where one is found the
kernel must build. The layer's measured ``KernelCut`` is pinned to "kernel everywhere" here but in
the tests of the cut itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe import kernels
from moe.kernels import host as kernels_host
from moe.layers import attention, attention_tuning, batched_attention, mla
from moe.layers.attention import PagedAttention
from moe.layers.batched_attention import KERNEL_EVERYWHERE, KernelCut
from moe.layers.mla import ABSORB_MAX_QUERY_LEN, PagedMLACache
from moe.platforms import current_platform
from tests.helpers.cpu_kernels import ISAS, kernel_module_for, needs_compiler
from tests.moe.test_batched_attention import BLOCK_SIZE, NUM_BLOCKS, make_metadata

# decode rows over contexts that end on and off block boundaries (4-token blocks; up to 6 blocks);
# with prefill chunks that start at 0 or mid-sequence and a request with no query row
DECODES = [(7, 1), (15, 1), (0, 1), (3, 1), (22, 1), (11, 1), (1, 1), (8, 1)]
MIXED = [(0, 5), (7, 1), (15, 1), (3, 9), (0, 1), (22, 1), (8, 4), (4, 0), (2, 1)]


@pytest.fixture(autouse=True)
def kernel_everywhere(monkeypatch):
    """Layers bound to a cache send every request to the kernel (no measured cut)."""
    monkeypatch.setattr(attention, "kernel_cut", lambda *_: KERNEL_EVERYWHERE)
    monkeypatch.setattr(mla, "mla_expanded_cut", lambda *_: math.inf)


@pytest.fixture(params=ISAS)
def isa(request) -> str:
    """Each ISA whose build this CPU runs (the others skip, saying why)."""
    kernel_module_for(request.param)
    return request.param


@pytest.fixture
def kernel_calls(monkeypatch, isa):
    """Counts calls of the compiled kernel built for ``isa``, which the layer then uses."""
    module = kernel_module_for(isa)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(module, name)

        def paged_attention(self, *args):
            calls.append(args[7].numel())  # requests with query rows
            return module.paged_attention(*args)

    monkeypatch.setattr(kernels_host, "cpu_kernels", lambda _isa: Counting())
    return calls


def make_op(
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    seed=1,
    *,
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
):
    op = PagedAttention(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim**-0.5
    )
    gen = torch.Generator().manual_seed(seed)
    shape = op.kv_cache_shape(num_blocks, block_size)
    op.bind_kv_cache(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
    return op


def inputs(op, num_tokens, dtype, seed=2):
    gen = torch.Generator().manual_seed(seed)
    width = (
        op.num_heads * op.head_dim,
        op.num_kv_heads * op.head_dim,
        op.num_kv_heads * op.head_dim,
    )
    # scaled so some softmax rows are peaked: the exp of large negative differences is exercised
    return [
        (3 * torch.randn(num_tokens, w, generator=gen, dtype=torch.float64)).to(dtype)
        for w in width
    ]


def reference(op, q, k, v, md):
    """forward_native in float64 on the same (rounded) inputs and cache."""
    ref = PagedAttention(
        num_heads=op.num_heads, num_kv_heads=op.num_kv_heads, head_dim=op.head_dim, scale=op.scale
    )
    ref.bind_kv_cache(op.kv_cache.double().clone())
    return ref.forward_native(q.double(), k.double(), v.double(), md)


@needs_compiler
def test_cpu_kernels_build_for_each_isa_on_a_machine_with_a_compiler(isa):
    module = kernels.cpu_kernels(isa)
    assert module.isa() == isa
    assert module.__name__ == f"moe_dbo_cpu_kernels_{isa}"
    label = re.escape(kernels.ISA_LABELS[isa])
    assert re.fullmatch(rf"ready \({label}\) in \d+\.\d s", kernels.prepare_cpu_kernels(isa))


@needs_compiler
def test_a_failed_build_falls_back_to_the_isa_below(monkeypatch):
    """A compiler without -mavx512bf16: the avx512_bf16 build fails and the avx512 one serves
    (the bfloat16 experts then take widened weights: their pack follows the module's isa())."""
    kernel_module_for("avx512")
    build = kernels._build
    monkeypatch.setattr(kernels, "_build", lambda isa: None if isa == "avx512_bf16" else build(isa))
    monkeypatch.setattr(kernels, "_modules", {})
    module = kernels.cpu_kernels("avx512_bf16")
    assert module is not None and module.isa() == "avx512"
    assert kernels.prepare_cpu_kernels("avx512_bf16").startswith("ready (AVX-512) in ")


@needs_compiler
def test_the_layer_runs_the_build_for_the_platforms_isa():
    """Under ATEN_CPU_CAPABILITY / MOE_DBO_CPU_ISA caps too: the capped ISA's build runs."""
    isa = current_platform().cpu_capability().isa
    if isa == "default":
        pytest.skip(f"no vector ISA here (torch: {torch.backends.cpu.get_cpu_capability()})")
    module = kernel_module_for(isa)
    op = make_op(4, 2, 16, torch.float32)
    q = torch.zeros(1, 4, 16, dtype=torch.float32)
    assert batched_attention.paged_attention_kernel(q, op.kv_cache) is module.paged_attention


def test_kernels_off_by_environment(monkeypatch):
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")
    assert kernels.cpu_kernels("avx2") is None
    assert kernels.prepare_cpu_kernels("avx2") == "off (MOE_DBO_CPU_KERNELS=0): plain torch paths"


def test_no_vector_isa_builds_nothing(monkeypatch):
    monkeypatch.setattr(kernels, "_build", lambda isa: pytest.fail(f"built for {isa}"))
    for isa in (None, "default"):
        assert kernels.cpu_kernels(isa) is None
        assert kernels.prepare_cpu_kernels(isa).startswith("not built (no AVX2 or AVX-512")


def test_unknown_isa_raises():
    with pytest.raises(
        ValueError, match=r"isa='neon': expected one of \['avx2', 'avx512', 'avx512_bf16'\]"
    ):
        kernels.cpu_kernels("neon")


@needs_compiler
@pytest.mark.parametrize("requests", [DECODES, MIXED])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_padding", [0, 3])
def test_kernel_equals_native_float64(kernel_calls, requests, group, num_padding):
    op = make_op(4 * group, 4, 8, torch.float64)
    native = make_op(4 * group, 4, 8, torch.float64)
    md = make_metadata(requests, num_padding=num_padding)
    q, k, v = inputs(op, md.num_tokens, torch.float64)
    expected = native.forward_native(q, k, v, md)
    got = op.forward_cpu(q, k, v, md)
    assert kernel_calls == [sum(1 for _, n in requests if n > 0)]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert not got[md.num_actual_tokens :].any()


def _kernel_on_mixed_batch(kernel_calls, head_dim, group, dtype):
    """forward_cpu on MIXED in ``dtype`` (2 KV heads, ``group`` query heads each): the op, its
    inputs, metadata and output, after checking that the kernel computed all 8 requests."""
    op = make_op(2 * group, 2, head_dim, dtype)
    md = make_metadata(MIXED, num_padding=1)
    q, k, v = inputs(op, md.num_tokens, dtype)
    got = op.forward_cpu(q, k, v, md)
    assert kernel_calls == [8]
    assert got.dtype == dtype
    return op, (q, k, v), md, got


# one AVX2 vector (half an AVX-512 one), one AVX-512 vector, 3 AVX2 vectors (1.5 AVX-512 ones: a
# scalar tail), and 8 or 16 vectors (AVX2 sums 128 in two column chunks)
HEAD_DIMS = [8, 16, 24, 64, 128]


def float32_bound(op, q, k, v, md, exact) -> float:
    """4x the error of the per-request reference run in float32 itself (two float32 roundings of
    the same sums: the scores' dot products, exp, the weighted sums), at least 1e-6."""
    native32 = op.forward_native(q, k, v, md).double()
    return max(1e-6, 4 * (native32 - exact).abs().max().item())


@needs_compiler
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_kernel_float32_within_the_reference_rounding(kernel_calls, head_dim, group):
    """float32: the error against the exact (float64) result stays within 4x that of the
    per-request reference run in float32 itself (two float32 roundings of the same sums: the
    scores' dot products, exp, the weighted sums), at least 1e-6."""
    op, (q, k, v), md, got = _kernel_on_mixed_batch(kernel_calls, head_dim, group, torch.float32)
    exact = reference(op, q, k, v, md)
    bound = float32_bound(op, q, k, v, md, exact)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=bound)


@needs_compiler
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_kernel_bfloat16_rounds_once(kernel_calls, head_dim, group):
    """bfloat16: the output is rounded once to bfloat16 (half an ulp: 2^-8 relative), the rest
    accumulates in float32 (~2^16 finer): within 2^-8 relative (1e-4 absolute near 0) of the
    exact result on the same bfloat16 inputs."""
    op, (q, k, v), md, got = _kernel_on_mixed_batch(kernel_calls, head_dim, group, torch.bfloat16)
    torch.testing.assert_close(got.double(), reference(op, q, k, v, md), rtol=2**-8, atol=1e-4)


# contexts of up to 512 positions in 16-token blocks: prefill chunks long enough for whole groups of
# key-transposed score tiles (8 tiles of 16 positions with AVX-512) plus partial tiles, decode rows
# over 258-512 positions, a request with no query row
LONG = [(0, 150), (300, 1), (130, 7), (257, 1), (64, 64), (5, 0), (511, 1)]
LONG_BLOCKS = dict(block_size=16, num_blocks=256, max_blocks=32)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 64])
def test_kernel_long_contexts(kernel_calls, dtype, head_dim):
    """float64 exact up to summation order; float32 and bfloat16 within the bounds above."""
    op = make_op(4, 2, head_dim, dtype, num_blocks=256, block_size=16)
    md = make_metadata(LONG, num_padding=1, **LONG_BLOCKS)
    q, k, v = inputs(op, md.num_tokens, dtype)
    exact = reference(op, q, k, v, md)
    got = op.forward_cpu(q, k, v, md).double()
    assert kernel_calls == [6]
    if dtype == torch.float64:
        torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=0, atol=float32_bound(op, q, k, v, md, exact))
    else:
        torch.testing.assert_close(got, exact, rtol=2**-8, atol=1e-4)


@needs_compiler
def test_kernel_request_cut_across_ubatches(kernel_calls):
    """A prefill chunk cut between the ubatches: the second part attends over the first part's
    cached K/V."""
    from dbo import make_ubatch_slices
    from moe.layers.attention_metadata import split_attn_metadata

    op, native = make_op(8, 4, 16, torch.float64), make_op(8, 4, 16, torch.float64)
    md = make_metadata([(6, 1), (2, 11), (9, 1), (0, 4), (13, 1)], num_padding=2)
    slices = make_ubatch_slices(md.query_start_loc, md.num_tokens)
    q, k, v = inputs(op, md.num_tokens, torch.float64)
    expected = native.forward_native(q, k, v, md)
    parts = [
        op.forward_cpu(q[s.token_slice], k[s.token_slice], v[s.token_slice], ub_md)
        for s, ub_md in zip(slices, split_attn_metadata(slices, md), strict=True)
    ]
    assert sum(kernel_calls) == 6  # the cut request is in both ubatches
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-12, atol=1e-12)


@needs_compiler
def test_kernel_not_used_for_mixed_dtypes(kernel_calls):
    op = make_op(4, 2, 16, torch.float32)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    assert batched_attention.paged_attention_kernel(q, op.kv_cache) is None
    assert batched_attention.paged_attention_kernel(q.float(), op.kv_cache) is not None


@needs_compiler
@pytest.mark.parametrize("num_padding", [0, 2])
def test_kernel_empty_ubatch(kernel_calls, num_padding):
    op = make_op(4, 2, 16, torch.float64)
    md = make_metadata([], num_padding=num_padding)
    q, k, v = inputs(op, num_padding, torch.float64)
    before = op.kv_cache.clone()
    out = op.forward_cpu(q, k, v, md)
    assert out.shape == (num_padding, 4 * 16) and not out.any()
    assert torch.equal(op.kv_cache, before)
    assert kernel_calls == []


def test_without_kernels_the_torch_path_equals_native(monkeypatch):
    monkeypatch.setenv("MOE_DBO_CPU_KERNELS", "0")
    op, native = make_op(8, 4, 16, torch.float64), make_op(8, 4, 16, torch.float64)
    md = make_metadata(MIXED, num_padding=1)
    q, k, v = inputs(op, md.num_tokens, torch.float64)
    torch.testing.assert_close(
        op.forward_cpu(q, k, v, md), native.forward_native(q, k, v, md), rtol=1e-12, atol=1e-12
    )


def _sleeper() -> subprocess.Popen:
    """A live process to hold a lock (killed by the caller)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _write_lock(path: Path, pid: int, host: str | None = None, age_s: float = 0.0) -> None:
    path.write_text(f"{pid} {host or socket.gethostname()}\n")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_a_build_lock_of_a_live_owner_is_waited_on_with_a_bound_and_a_line(tmp_path, caplog):
    """A start waits for another process's build, saying for whom, and gives up after the bound
    (the plain torch paths run) instead of waiting forever."""
    owner = _sleeper()
    try:
        _write_lock(tmp_path / kernels.BUILD_LOCK, owner.pid, age_s=12)
        with caplog.at_level(logging.WARNING, logger="moe.kernels"):
            gave_up = kernels._acquire_build_lock(tmp_path, timeout_s=0.5)
    finally:
        owner.kill()
        owner.wait()
    lock = tmp_path / kernels.BUILD_LOCK
    assert re.fullmatch(
        rf"gave up after \d+ s waiting for the build lock {re.escape(str(lock))} held by pid "
        rf"{owner.pid} \(alive\)",
        gave_up,
    )
    waiting = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert waiting == [
        f"moe-dbo: waiting for the CPU kernel build lock {lock} held by pid {owner.pid} (alive) "
        "for 12 s"
    ]
    assert lock.read_text().split()[0] == str(owner.pid)  # a live owner's lock is kept


def test_a_build_lock_of_a_dead_or_stale_owner_is_taken_over_at_once(tmp_path):
    dead = _sleeper()
    dead.kill()
    dead.wait()
    lock = tmp_path / kernels.BUILD_LOCK
    for pid, host, age_s in (
        (dead.pid, None, 0.0),  # this host's dead pid: at once, whatever its age
        (1, "another-host", kernels.STALE_LOCK_SECONDS + 10),  # not checkable: by its age
    ):
        _write_lock(lock, pid, host, age_s)
        start = time.monotonic()
        assert kernels._acquire_build_lock(tmp_path, timeout_s=30) is None
        assert time.monotonic() - start < 5
        assert lock.read_text().split() == [str(os.getpid()), socket.gethostname()]
        kernels._release_build_lock(tmp_path)
        assert not lock.exists()
    # another host's fresh lock cannot be checked: waited on up to the bound
    _write_lock(lock, 1, "another-host", 1.0)
    assert "held by pid 1 on another-host" in kernels._acquire_build_lock(tmp_path, timeout_s=0.2)


def test_a_killed_builds_torch_lock_does_not_hang_the_next_start(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's lock (no owner in it) behind; torch waits on it
    without a timeout. The next start takes our lock and removes torch's, then builds: here with a
    stand-in for torch's ``load`` that waits on its lock exactly as torch does."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    def load(*, name, sources, extra_cflags, build_directory, verbose):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if not baton.try_acquire():
            baton.wait()  # torch's: no timeout
            return None
        baton.release()
        return types.SimpleNamespace(isa=lambda: "avx2", name=name)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load)
    directory = kernels.build_directory("avx2")
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # fresh: the old age check (300 s) kept it
    result = []
    builder = threading.Thread(target=lambda: result.append(kernels._build("avx2")), daemon=True)
    builder.start()
    builder.join(timeout=30)
    hung = builder.is_alive()
    (directory / "lock").unlink(missing_ok=True)  # lets a hung builder end
    assert not hung, "the start waited on a dead build's lock"
    assert result[0].name == "moe_dbo_cpu_kernels_avx2"
    assert not (directory / kernels.BUILD_LOCK).exists()  # released after the build


def test_a_start_that_gives_up_on_the_lock_runs_the_plain_paths_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "BUILD_LOCK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_failures", {})
    directory = kernels.build_directory("avx2")
    directory.mkdir(parents=True)
    owner = _sleeper()
    try:
        _write_lock(directory / kernels.BUILD_LOCK, owner.pid)
        line = kernels.prepare_cpu_kernels("avx2")
    finally:
        owner.kill()
        owner.wait()
    assert line.startswith("not built (gave up after 0 s waiting for the build lock ")
    assert line.endswith(f"held by pid {owner.pid} (alive)): plain torch paths")


def test_builds_go_where_torch_extensions_dir_says(monkeypatch, tmp_path):
    """``TORCH_EXTENSIONS_DIR`` moves the builds (and their tuning) as it moves torch's own; unset,
    torch's per-user default."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels.build_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert kernels.build_root() == Path(get_default_build_root())


# keys 80 wide (the latent and the RoPE key), values 64 (the latent)
MLA_LAYOUT = attention_tuning.MLALayout(num_heads=4, nope=8, rope=16, v=16, kv_lora_rank=64)


def _mla_ops(dtype, **blocks):
    """Two MLA caches of ``MLA_LAYOUT`` holding the same random latents in ``dtype`` (the op's
    and the reference's, the latter in float64)."""
    num_blocks, block_size = blocks.get("num_blocks", NUM_BLOCKS), blocks.get("block_size", 4)
    op = PagedMLACache(MLA_LAYOUT)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(op.kv_cache_shape(num_blocks, block_size), generator=gen).to(dtype)
    op.bind_kv_cache(cache)
    ref = PagedMLACache(MLA_LAYOUT)
    ref.bind_kv_cache(cache.double().clone())
    return op, ref


def _mla_inputs(op, num_tokens, dtype):
    lay = op.layout
    gen = torch.Generator().manual_seed(4)
    shapes = {
        "q_nope": (num_tokens, lay.num_heads, lay.nope),
        "q_pe": (num_tokens, lay.num_heads, lay.rope),
        "w": (lay.num_heads * (lay.nope + lay.v), lay.kv_lora_rank),
    }
    return {k: torch.randn(s, generator=gen).div(4).to(dtype) for k, s in shapes.items()}


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("requests", "blocks"), [(MIXED, {}), (LONG, LONG_BLOCKS)])
def test_kernel_mla_absorbed_equals_native(kernel_calls, dtype, requests, blocks):
    """MLA's absorbed requests (1-4 query rows) in one kernel call over the latents in place
    (keys the [kv_c, k_pe] rows, values their first kv_lora_rank elements), the others over their
    expanded keys and values, a kernel call per chunk:
    float64 exact up to summation order; float32 and bfloat16 within 4x the error of the
    per-request reference run in that dtype itself (the same roundings: q_lat, the attention, the
    W_UV product), at least 1e-6 in float32 and 2^-8 in bfloat16."""
    op, ref = _mla_ops(dtype, **blocks)
    md = make_metadata(requests, num_padding=1, **blocks)
    x = _mla_inputs(op, md.num_tokens, dtype)
    args = (x["q_nope"], x["q_pe"], x["w"], md)
    got = op.forward_cpu(*args, scale=0.3).double()
    exact = ref.forward_native(*(t.double() for t in args[:3]), md, scale=0.3)
    # one call for the absorbed requests, then one per chunk of expanded ones
    assert kernel_calls[0] == sum(1 for _, n in requests if 1 <= n <= ABSORB_MAX_QUERY_LEN)
    assert sum(kernel_calls) == sum(1 for _, n in requests if n > 0)
    assert not got[md.num_actual_tokens :].any()
    if dtype == torch.float64:
        torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12)
        return
    ref_dtype = op.forward_native(*args, scale=0.3).double()
    floor = 1e-6 if dtype == torch.float32 else 2**-8
    bound = max(floor, 4 * (ref_dtype - exact).abs().max().item())
    torch.testing.assert_close(got, exact, rtol=0, atol=bound)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mla_expanded_chunks_past_the_cut_take_sdpa(kernel_calls, dtype):
    """With ``expanded_cut`` below the expanded chunk's longest query (9 rows in MIXED), that
    chunk attends through the padded SDPA and only the absorbed requests reach the kernel; the
    result equals the reference as on the kernel (float64 to 1e-12, float32 within 4x the float32
    reference's error)."""
    op, ref = _mla_ops(dtype)
    op.expanded_cut = 6
    md = make_metadata(MIXED, num_padding=1)
    x = _mla_inputs(op, md.num_tokens, dtype)
    args = (x["q_nope"], x["q_pe"], x["w"], md)
    got = op.forward_cpu(*args, scale=0.3).double()
    assert kernel_calls == [sum(1 for _, n in MIXED if 1 <= n <= ABSORB_MAX_QUERY_LEN)]
    exact = ref.forward_native(*(t.double() for t in args[:3]), md, scale=0.3)
    bound = 1e-12
    if dtype == torch.float32:
        bound = max(1e-6, 4 * (op.forward_native(*args, scale=0.3).double() - exact).abs().max())
    torch.testing.assert_close(got, exact, rtol=0, atol=float(bound))
    assert not got[md.num_actual_tokens :].any()


@needs_compiler
def test_binding_an_mla_cache_measures_its_expanded_cut(tuning_file, monkeypatch):
    """Binding a float32 / bfloat16 cache measures the expanded requests' cut once per layout
    (one of 0, 8, 16, ... or inf); on float64 the kernel keeps them all, unmeasured."""
    monkeypatch.setattr(mla, "mla_expanded_cut", attention_tuning.mla_expanded_cut)
    measured = []
    real_measure = attention_tuning._measure_mla
    monkeypatch.setattr(
        attention_tuning, "_measure_mla", lambda *a: measured.append(a) or real_measure(*a)
    )
    caches = [PagedMLACache(MLA_LAYOUT) for _ in range(2)]
    for cache in caches:
        cache.bind_kv_cache(torch.zeros(cache.kv_cache_shape(8, 16)))
    cut = caches[0].expanded_cut
    assert len(measured) == 1 and caches[1].expanded_cut == cut
    assert cut == math.inf or cut == 0 or (cut >= 8 and math.log2(cut).is_integer())
    (key,) = json.loads(tuning_file.read_text())
    assert key.startswith("mla torch.float32 heads=4 nope=8 rope=16 v=16 kv_lora_rank=64 expanded")
    wide = PagedMLACache(MLA_LAYOUT)
    wide.bind_kv_cache(torch.zeros(wide.kv_cache_shape(8, 16), dtype=torch.float64))
    assert wide.expanded_cut == math.inf and len(measured) == 1


@needs_compiler
def test_kernel_refuses_mismatched_k_v_and_out(isa):
    """K and V are views of their own widths; shapes that do not fit together raise before any
    work (the output is left as it was)."""
    module = kernel_module_for(isa)
    cache = torch.randn(2, 8, 4, 2, 16)
    query = torch.randn(3, 4, 16)
    meta = (
        torch.zeros(1, 2, dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([0]),
    )
    out = torch.zeros(3, 4, 8)  # values 16 wide: out must be [3, 4, 16]
    with pytest.raises(RuntimeError, match=r"out: \[T, H, v_head_dim\]"):
        module.paged_attention(out, query, cache[0], cache[1], *meta, 0.25)
    assert not out.any()
    with pytest.raises(RuntimeError, match="differ in blocks, block size or KV heads"):
        module.paged_attention(query.clone(), query, cache[0], cache[1, :4], *meta, 0.25)
    with pytest.raises(RuntimeError, match="the last dim must be contiguous"):
        v = cache[1].transpose(2, 3).contiguous().transpose(2, 3)
        module.paged_attention(query.clone(), query, cache[0], v, *meta, 0.25)
    # a V narrower than K (as MLA's latent rows): out takes V's width; causal GQA (2 query heads
    # per KV head) over the request's 3 positions, all in block 0
    out = torch.zeros(3, 4, 8)
    module.paged_attention(out, query, cache[0], cache[1, ..., :8], *meta, 0.25)
    k = cache[0, 0, :3].repeat_interleave(2, dim=1).transpose(0, 1)  # [4, 3, 16]
    v = cache[1, 0, :3, :, :8].repeat_interleave(2, dim=1).transpose(0, 1)  # [4, 3, 8]
    expected = F.scaled_dot_product_attention(
        query.transpose(0, 1), k, v, is_causal=True, scale=0.25
    )
    torch.testing.assert_close(out, expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_kernel_cut_sends_long_queries_to_sdpa():
    """Hand-worked on MIXED ((cached, rows) per request): over a context at least as long as the
    query, past ``over_context``; otherwise past ``fresh``; a request with no rows never."""
    md = make_metadata(MIXED)
    cut = KernelCut(fresh=4, over_context=1)
    to_sdpa = cut.to_sdpa(md.query_lens.long(), md.seq_lens.long())
    # (0, 5) fresh 5 > 4; (3, 9) fresh; (8, 4) over context 4 > 1; (4, 0) and the decodes: no
    assert to_sdpa.tolist() == [True, False, False, True, False, False, True, False, False]
    assert not KERNEL_EVERYWHERE.to_sdpa(md.query_lens.long(), md.seq_lens.long()).any()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_requests_past_the_cut_take_sdpa_and_the_rest_the_kernel(kernel_calls, dtype):
    """The two paths in one batch equal the reference: the kernel gets only the 5 requests
    within the cut (decode rows), SDPA the 3 past it."""
    op = make_op(4, 2, 16, dtype)
    op.kernel_cut = KernelCut(fresh=4, over_context=1)
    md = make_metadata(MIXED, num_padding=1)
    q, k, v = inputs(op, md.num_tokens, dtype)
    got = op.forward_cpu(q, k, v, md)
    assert kernel_calls == [5]
    exact = reference(op, q, k, v, md)
    bound = 1e-12 if dtype == torch.float64 else float32_bound(op, q, k, v, md, exact)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=bound)
    assert not got[md.num_actual_tokens :].any()
    kernel_calls.clear()
    op.kernel_cut = batched_attention.SDPA_EVERYWHERE
    torch.testing.assert_close(op.forward_cpu(q, k, v, md).double(), exact, rtol=0, atol=bound)
    assert kernel_calls == []


@needs_compiler
def test_binding_a_cache_measures_the_cut_once_per_layout(tuning_file, monkeypatch):
    """float32 / bfloat16 caches: both kinds measured through both paths, kept under the layout's
    key, one of 0, 1, 2, 4, ... or inf; a second layer of the layout reads it; float64 caches
    (references) keep the kernel everywhere, unmeasured."""
    monkeypatch.setattr(attention, "kernel_cut", attention_tuning.kernel_cut)
    measured = []
    real_measure = attention_tuning._measure

    def counting_measure(*args, **kwargs):
        measured.append((args, kwargs["over_context"]))
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(attention_tuning, "_measure", counting_measure)
    cut = make_op(4, 2, 16, torch.float32).kernel_cut
    assert len(measured) == 2 and make_op(4, 2, 16, torch.float32).kernel_cut == cut
    for rows in (cut.fresh, cut.over_context):
        assert rows == math.inf or rows == 0 or math.log2(rows).is_integer()
    keys = sorted(json.loads(tuning_file.read_text()))
    assert [key.split(" threads=")[0] for key in keys] == [
        "attention torch.float32 heads=4/2 head_dim=16 fresh",
        "attention torch.float32 heads=4/2 head_dim=16 over_context",
    ]
    assert make_op(4, 2, 16, torch.float64).kernel_cut == KERNEL_EVERYWHERE
    assert len(measured) == 2
