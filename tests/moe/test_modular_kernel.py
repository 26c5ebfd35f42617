"""FusedMoEModularKernel: NoEP vs a dense per-token reference, the DBO yield/recv-hook schedule,
and EP=2 over real gloo all-to-all backends (with and without DBO) vs the single-rank model."""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from dbo import UBatchWrapper, dbo_current_ubatch_id, make_ubatch_contexts, make_ubatch_slices
from dbo.forward_context import DPMetadata
from distributed import CommTiming, FusedMoEActivationFormat, make_prepare_finalize
from distributed.all2all.base import DEBUG_CHECKS_ENV
from moe import (
    FusedMoEModularKernel,
    MoEModelConfig,
    NoEPPrepareAndFinalize,
    TorchExperts,
    build_model,
    init_random_weights,
    select_experts,
)
from tests.helpers.distributed import platform_communicators, run_distributed
from tests.helpers.forward_context import context_forward, ubatch_scopes

H, FF, E, K = 16, 24, 4, 2


def make_experts(num_local_experts=E, seed=0):
    experts = TorchExperts(num_local_experts=num_local_experts, hidden_size=H, intermediate_size=FF)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts


def dense_reference(experts, x, topk_ids, topk_weights):
    """Per token, per slot: w * W2 (silu(W1 x) * W3 x); ids -1 skipped."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[n, k])
            if e < 0:
                continue
            h = F.silu(experts.w1[e] @ x[n]) * (experts.w3[e] @ x[n])
            out[n] += topk_weights[n, k] * (experts.w2[e] @ h)
    return out


def routed(num_tokens, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    routing = select_experts(torch.randn(num_tokens, E, generator=gen), K)
    return x, routing.topk_ids, routing.topk_weights


@torch.no_grad()
def test_noep_kernel_matches_dense_reference():
    experts = make_experts()
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=E), experts)
    x, ids, w = routed(13)
    torch.testing.assert_close(
        kernel.forward(x, ids, w), dense_reference(experts, x, ids, w), atol=1e-5, rtol=1e-5
    )


@torch.no_grad()
def test_shared_experts_are_added():
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=E), make_experts())
    x, ids, w = routed(5)
    out = kernel.forward(x, ids, w, shared_experts=lambda t: 2 * t)
    torch.testing.assert_close(out, kernel.forward(x, ids, w) + 2 * x)


@torch.no_grad()
def test_experts_skip_minus_one_and_accept_zero_tokens():
    experts = make_experts(num_local_experts=2)
    x, _, w = routed(6)
    ids = torch.tensor([[0, -1], [-1, -1], [1, 0], [-1, 1], [1, -1], [0, 1]])
    torch.testing.assert_close(
        experts.apply_standard(x, ids, w), dense_reference(experts, x, ids, w), atol=1e-5, rtol=1e-5
    )
    assert experts.apply_standard(x, ids, w)[1].abs().sum() == 0
    assert experts.apply_standard(x[:0], ids[:0], w[:0]).shape == (0, H)
    with pytest.raises(ValueError, match=r"local expert id 2 >= num_local_experts=2"):
        experts.apply_standard(x, torch.full_like(ids, 2), w)


@torch.no_grad()
def test_batched_experts_equal_the_experts_on_the_same_tokens(monkeypatch):
    """DeepEP low-latency layout ([E, M, H] rows per expert + counts, unweighted outputs, weights
    applied afterwards) gives the same result as ``apply_standard`` on the routed tokens
    (float64). The shape check runs under the debug flag (the counts' on the host paths always)."""
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    experts = make_experts().double()
    x, ids, w = routed(11)
    x, w = x.double(), w.double()
    max_tokens = 13  # more slots than tokens: rows past each count are garbage, ignored
    batched = torch.full((E, max_tokens, H), float("nan"), dtype=torch.float64)
    counts = torch.zeros(E, dtype=torch.int32)
    where = []  # (token, slot, expert, row)
    for n in range(x.shape[0]):
        for k in range(K):
            e = int(ids[n, k])
            batched[e, counts[e]] = x[n]
            where.append((n, k, e, int(counts[e])))
            counts[e] += 1
    out = experts.apply_batched(batched, counts)
    assert out.shape == batched.shape and out.dtype == torch.float64
    for e in range(E):
        assert not out[e, counts[e] :].any()  # rows past the count stay zero
    combined = torch.zeros_like(x)
    for n, k, e, row in where:
        combined[n] += w[n, k] * out[e, row]
    torch.testing.assert_close(combined, experts.apply_standard(x, ids, w), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(combined, experts.forward_native(x, ids, w), rtol=1e-12, atol=1e-12)
    assert not experts.apply_batched(batched, torch.zeros(E, dtype=torch.int32)).any()
    with pytest.raises(ValueError, match=r"expert_num_tokens must hold 4 counts in \[0, 13\]"):
        experts.apply_batched(batched, torch.full((E,), 14, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"hidden_states must be \[4, max_tokens, 16\]"):
        experts.apply_batched(batched[:2], counts[:2])


def test_kernel_rejects_mismatched_local_expert_count():
    with pytest.raises(ValueError, match=r"serves 4 local experts but experts holds 2"):
        FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=4), make_experts(2))


def _local_low_latency():
    """DeepEP low latency on one rank (our emulation): the ``BatchedExperts`` format."""
    backend = make_prepare_finalize(
        "deepep_low_latency",
        ep_group=None,
        ep_rank=0,
        ep_size=1,
        num_experts=E,
        timeout=datetime.timedelta(seconds=5),
        num_max_dispatch_tokens_per_rank=16,
    )
    return backend


class _StandardOnlyExperts(TorchExperts):
    activation_formats = (FusedMoEActivationFormat.Standard,)


class _BatchedOnlyExperts(TorchExperts):
    activation_formats = (FusedMoEActivationFormat.BatchedExperts,)


def test_kernel_refuses_experts_that_do_not_take_the_backends_format():
    kw = {"num_local_experts": E, "hidden_size": H, "intermediate_size": FF}
    with pytest.raises(
        ValueError,
        match=r"^_StandardOnlyExperts takes activation formats \['standard'\] but "
        r"DeepEPLLPrepareAndFinalize delivers 'batched_experts'$",
    ):
        FusedMoEModularKernel(_local_low_latency(), _StandardOnlyExperts(**kw))
    with pytest.raises(
        ValueError,
        match=r"^_BatchedOnlyExperts takes activation formats \['batched_experts'\] but "
        r"NoEPPrepareAndFinalize delivers 'standard'$",
    ):
        FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=E), _BatchedOnlyExperts(**kw))
    # each accepts the format it declares
    FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=E), _StandardOnlyExperts(**kw))
    FusedMoEModularKernel(_local_low_latency(), _BatchedOnlyExperts(**kw))


@torch.no_grad()
def test_kernel_runs_the_batched_experts_on_a_batched_backend():
    """The batched path (DeepEP low latency on one rank: unweighted experts, weights applied by
    the combine) gives the standard path's output (float64)."""
    experts = make_experts().double()
    x, ids, w = routed(11)
    x = x.double()
    batched = FusedMoEModularKernel(_local_low_latency(), experts)
    standard = FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=E), experts)
    torch.testing.assert_close(
        batched.forward(x, ids, w), standard.forward(x, ids, w), rtol=1e-12, atol=1e-12
    )


class _LazyHandle:
    """A CommHandle: completes on the first wait() and logs which ubatch completed it."""

    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value
        self.timing = CommTiming(issued_at_ns=time.perf_counter_ns(), num_bytes=0)

    def is_completed(self):
        return self.timing.completed_at_ns is not None

    def wait(self):
        if self.timing.completed_at_ns is None:
            now_ns = time.perf_counter_ns()
            self.timing = dataclasses.replace(self.timing, completed_at_ns=now_ns)
            self.log.append(("complete", self.name, dbo_current_ubatch_id()))
        return self.value


class _RecordingPrepareFinalize(NoEPPrepareAndFinalize):
    def __init__(self, log):
        super().__init__(num_experts=E)
        self.log = log

    def dispatch(
        self, hidden_states, topk_ids, topk_weights, *, async_op, num_tokens_across_ep=None
    ):
        ub = dbo_current_ubatch_id()
        self.log.append(("issue", f"D{ub}", ub, async_op))
        result = super().dispatch(hidden_states, topk_ids, topk_weights, async_op=async_op)
        return _LazyHandle(self.log, f"D{ub}", result.wait())

    def combine(self, expert_output, metadata, *, async_op):
        ub = dbo_current_ubatch_id()
        self.log.append(("issue", f"C{ub}", ub, async_op))
        return _LazyHandle(self.log, f"C{ub}", expert_output)


# Each transfer is completed by the OTHER ubatch's recv hook; shared experts run between issuing the
# combine and yielding. vLLM's order completes the other's transfer before issuing one's own; the
# CPU order issues first (the last hook runs when ubatch 0 leaves its context).
VLLM_ORDER = [
    ("issue", "D0", 0, True),
    ("complete", "D0", 1),
    ("issue", "D1", 1, True),
    ("complete", "D1", 0),
    ("issue", "C0", 0, True),
    ("shared", 0),
    ("complete", "C0", 1),
    ("issue", "C1", 1, True),
    ("shared", 1),
    ("complete", "C1", 0),
]
ISSUE_FIRST_ORDER = [
    ("issue", "D0", 0, True),
    ("issue", "D1", 1, True),
    ("complete", "D0", 1),
    ("issue", "C0", 0, True),
    ("complete", "D1", 0),
    ("shared", 0),
    ("issue", "C1", 1, True),
    ("complete", "C0", 1),
    ("shared", 1),
    ("complete", "C1", 0),
]
# Three ubatches, CPU order: each transfer is completed by the ubatch before its owner in the
# ring (D0 by ubatch 2, D1 by ubatch 0, ...), after that ubatch issued its own: D0 stays in flight
# while ubatches 1 and 2 compute.
ISSUE_FIRST_ORDER_3 = [
    ("issue", "D0", 0, True),
    ("issue", "D1", 1, True),
    ("issue", "D2", 2, True),
    ("complete", "D0", 2),
    ("issue", "C0", 0, True),
    ("complete", "D1", 0),
    ("shared", 0),
    ("issue", "C1", 1, True),
    ("complete", "D2", 1),
    ("shared", 1),
    ("issue", "C2", 2, True),
    ("complete", "C0", 2),
    ("shared", 2),
    ("complete", "C1", 0),
    ("complete", "C2", 1),
]


def test_cpu_platform_issues_before_running_the_other_ubatchs_hook():
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(num_experts=E), make_experts())
    assert kernel.issue_before_recv_hook  # the tests run on the CPU platform


@torch.no_grad()
@pytest.mark.parametrize(
    ("issue_first", "num_ubatches", "order"),
    [(False, 2, VLLM_ORDER), (True, 2, ISSUE_FIRST_ORDER), (True, 3, ISSUE_FIRST_ORDER_3)],
)
def test_dbo_schedule_follows_the_yield_protocol(issue_first, num_ubatches, order):
    log: list = []
    experts = make_experts()
    kernel = FusedMoEModularKernel(
        _RecordingPrepareFinalize(log), experts, issue_before_recv_hook=issue_first
    )
    x, ids, w = routed(4 * num_ubatches)
    expected = dense_reference(experts, x, ids, w) + 0.5 * x

    def shared(t):
        log.append(("shared", dbo_current_ubatch_id()))
        return 0.5 * t

    contexts = make_ubatch_contexts(num_ubatches, timeout_s=10.0)
    outputs: list = [None] * num_ubatches
    errors: list = []

    def run(i):
        try:
            with contexts[i]:
                rows = slice(4 * i, 4 * i + 4)
                outputs[i] = kernel.forward(x[rows], ids[rows], w[rows], shared_experts=shared)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_ubatches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10.0)
    assert not errors, errors
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-5, rtol=1e-5)
    assert log == order

    log.clear()
    kernel.forward(x, ids, w)  # DBO off: synchronous, nothing to hand over
    assert [e[:4] for e in log if e[0] == "issue"] == [
        ("issue", "D0", 0, False),
        ("issue", "C0", 0, False),
    ]


# ---- EP=2 over gloo: the same model, sharded over two ranks, equals the single-rank model ----

CONFIG = MoEModelConfig(
    vocab_size=64,
    hidden_size=H,
    intermediate_size=FF,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    num_experts=E,
    num_experts_per_tok=K,
    max_position_embeddings=128,
)
BLOCK_SIZE = 4


def _metadata(query_lens, num_padding):
    from moe.layers.attention_metadata import CommonAttentionMetadata

    qsl, slots, table = [0], [], []
    for r, q in enumerate(query_lens):
        qsl.append(qsl[-1] + q)
        table.append([2 * r, 2 * r + 1])
        slots += [(2 * r + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(q)]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        num_reqs=len(query_lens),
        num_actual_tokens=qsl[-1],
        num_tokens=qsl[-1] + num_padding,
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
    )


def _ep_rank_main(rank, world_size, backend_names):
    from distributed import init_distributed

    groups = init_distributed(  # the engine's transport: shared memory on one host
        data_parallel_size=world_size,
        enable_expert_parallel=True,
        timeout_s=60,
        make_communicator=platform_communicators(60),
    )
    # one spawn for every backend: process start-up dominates the cost of this test
    return {
        name: _compare_ep_to_reference(rank, world_size, groups, name) for name in backend_names
    }


def _compare_ep_to_reference(rank, world_size, groups, backend_name):
    from distributed import make_prepare_finalize

    backend = make_prepare_finalize(
        backend_name,
        ep_group=groups.ep_group,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        num_experts=CONFIG.num_experts,
        timeout=groups.timeout,
    )
    model = build_model(
        CONFIG, ep_rank=groups.ep_rank, ep_size=groups.ep_size, prepare_finalize=backend
    )
    reference = build_model(CONFIG)
    init_random_weights(model, seed=3)
    init_random_weights(reference, seed=3)
    assert model.model.layers[0].block_sparse_moe.experts.w1.shape[0] == E // world_size

    # Rank 0: two requests (5 + 3 tokens); rank 1: one request of 6 tokens + 2 padding rows.
    query_lens, num_padding = ([5, 3], 0) if rank == 0 else ([6], 2)
    meta = _metadata(query_lens, num_padding)
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, CONFIG.vocab_size, (meta.num_tokens,), generator=gen)
    pos = torch.cat(
        [torch.arange(q) for q in query_lens] + [torch.zeros(num_padding, dtype=torch.long)]
    )

    forward = context_forward(model)

    def in_inference_mode(input_ids, positions):
        # like the engine: each ubatch thread enters inference_mode itself, and the other ubatch
        # completes this one's last combine at context exit, outside it
        with torch.inference_mode():
            return forward(input_ids, positions)

    def agreed(ubatch_slice):
        # a ubatch's EP counts as the engine knows them after the DP vote (every rank cuts its 8
        # rows at the same points), sparing the backends their count exchange
        return DPMetadata(
            num_tokens_across_dp=(ubatch_slice.num_tokens,) * world_size,
            dp_rank_of_ep_rank=groups.dp_rank_of_ep_rank,
        )

    def run(m, wrapper_slices=None, model_fn=forward, *, agreed_counts=False):
        m.allocate_kv_caches(8, BLOCK_SIZE)
        if wrapper_slices is None:
            return m(ids, pos, meta)
        scopes = ubatch_scopes(wrapper_slices, meta, agreed if agreed_counts else lambda s: None)
        return UBatchWrapper(model_fn, timeout_s=60)(ids, pos, wrapper_slices, ubatch_scopes=scopes)

    n = meta.num_actual_tokens
    expected = run(reference)[:n]
    slices = make_ubatch_slices(meta.query_start_loc, meta.num_tokens)
    # three ubatches: rank 0's first request is cut at row 2, rank 1's one request twice
    three = make_ubatch_slices(meta.query_start_loc, meta.num_tokens, 3)
    outputs = [
        run(model)[:n],
        run(model, slices)[:n],
        run(model, slices, in_inference_mode)[:n],
        run(model, three, in_inference_mode)[:n],
        run(model, three, in_inference_mode, agreed_counts=True)[:n],
    ]
    return [(out - expected).abs().max().item() for out in outputs]


def test_ep2_model_matches_single_rank_with_and_without_dbo():
    backend_names = [
        "all_to_all",
        "allgather_reducescatter",
        "deepep_high_throughput",
        "deepep_low_latency",
    ]
    results = run_distributed(_ep_rank_main, 2, backend_names, timeout_s=120)
    for per_rank in results:
        assert sorted(per_rank) == sorted(backend_names)
        # EP, EP + DBO, EP + DBO under inference_mode, the same with three ubatches, and with
        # the ubatches' EP counts known from the forward context
        for diffs in per_rank.values():
            assert len(diffs) == 5 and max(diffs) < 1e-5, results


def _hook_failure_rank(rank, world_size, device_type="cpu"):
    """Rank 0's DeepEP low-latency receive hook of ubatch 1 of 3 (run by ubatch 0) raises inside a
    DBO step; report each rank's error. ``device_type="cuda"``: both ranks share one GPU."""
    from distributed import make_prepare_finalize
    from moe.platforms import CpuPlatform, CudaPlatform
    from tests.helpers.gpu import placed_groups

    platform = CudaPlatform() if device_type == "cuda" else CpuPlatform()
    _, groups = placed_groups(platform, rank, world_size, timeout_s=3)
    backend = make_prepare_finalize(
        "deepep_low_latency",
        ep_group=groups.ep_group,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        num_experts=CONFIG.num_experts,
        timeout=groups.timeout,
        num_max_dispatch_tokens_per_rank=16,
    )
    if rank == 0:
        dispatch = backend.buffer.low_latency_dispatch

        def failing_dispatch(*args, **kwargs):
            recv_x, recv_count, handle, event, hook = dispatch(*args, **kwargs)
            if dbo_current_ubatch_id() != 1:
                return recv_x, recv_count, handle, event, hook

            def failing_hook():
                raise RuntimeError("injected failure in rank 0's receive hook")

            return recv_x, recv_count, handle, event, failing_hook

        backend.buffer.low_latency_dispatch = failing_dispatch
    model = build_model(
        CONFIG,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        prepare_finalize=backend,
        device=groups.device,
    )
    init_random_weights(model, seed=3)
    model.allocate_kv_caches(8, BLOCK_SIZE)
    meta = _metadata([5, 3], 0)  # on the host, as the engine's
    ids = torch.arange(meta.num_tokens, device=groups.device) % CONFIG.vocab_size
    pos = torch.cat([torch.arange(5), torch.arange(3)]).to(groups.device)
    slices = make_ubatch_slices(meta.query_start_loc, meta.num_tokens, 3)
    wrapper = UBatchWrapper(
        context_forward(model), timeout_s=3, make_streams=platform.make_ubatch_streams
    )
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            wrapper(ids, pos, slices, ubatch_scopes=ubatch_scopes(slices, meta))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return None, "", time.perf_counter() - start


@pytest.mark.parametrize(
    "device_type",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_an_exception_in_one_ranks_hook_is_an_error_on_every_rank(device_type):
    (kind0, msg0, _), (kind1, msg1, elapsed1) = run_distributed(
        _hook_failure_rank, 2, device_type, timeout_s=60
    )
    assert kind0 == "RuntimeError" and "injected failure in rank 0's receive hook" in msg0
    # the peer blocks in the next collective rank 0 never joins: an error within the timeout
    assert kind1 in ("TimeoutError", "RuntimeError"), (kind1, msg1)
    assert elapsed1 < 3 + 5, elapsed1
