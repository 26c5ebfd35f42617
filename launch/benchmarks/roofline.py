"""Roofline benchmark (``launch.bench_throughput --roofline``): how close a measured step runs to
its device's limits, the bytes a step must read over the measured copy bandwidth (decode) and its
matrix FLOPs over the measured matmul peak (prefill). What is counted:
docs/benchmarks.md#roofline-what-a-step-must-read."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moe.fused_moe.layer import FusedMoE
from moe.models.causal_lm import parameter_bytes


def _timed(fn: Callable[[], object], synchronize: Callable[[], None], reps: int) -> float:
    """Best seconds of ``reps`` calls of ``fn`` (after one warm-up), device work included."""
    fn()
    synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, synchronize: Callable[[], None], mib: int = 256) -> float:
    """Bytes per second of a ``mib`` MiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _timed(lambda: dst.copy_(src), synchronize, reps=5)


def matmul_peak(
    device: torch.device, dtype: torch.dtype, synchronize: Callable[[], None], n: int = 4096
) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` on ``device``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _timed(lambda: a @ b, synchronize, reps=3)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelTraffic:
    """What one rank's model reads per step, from its parameters and config.

    Attributes:
        dense_bytes: every parameter but the routed experts and the input embedding table.
        expert_bytes: one routed expert of one layer (its three matrices).
        num_moe_layers, num_local_experts, top_k: the routed experts' layout.
        dense_params, expert_params: parameter counts (FLOPs per token: twice these).
        lm_head_params: ``lm_head``'s parameters (multiplied by sampled rows only).
        kv_bytes_per_token: K/V bytes of one token over all layers.
        attention_flops_per_context_token: per query row and cached token, over all layers.
    """

    dense_bytes: int
    expert_bytes: int
    num_moe_layers: int
    num_local_experts: int
    top_k: int
    dense_params: int
    expert_params: int
    lm_head_params: int
    kv_bytes_per_token: int
    attention_flops_per_context_token: int

    @classmethod
    def of(cls, model, dtype: torch.dtype) -> ModelTraffic:
        """The traffic of ``model`` (an ``MoEForCausalLM``) running in ``dtype``."""
        config = model.config
        moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        by_category = parameter_bytes(model)
        itemsize = torch.empty((), dtype=dtype).element_size()
        embed = model.model.embed_tokens.weight
        tied = embed is model.lm_head.weight
        expert_total = by_category["routed_experts"]
        num_experts = max(
            1, len(moe_layers) * (moe_layers[0].num_local_experts if moe_layers else 1)
        )
        dense = sum(by_category.values()) - expert_total - (0 if tied else embed.numel() * itemsize)
        lm_head = model.lm_head.weight.numel()
        heads = config.num_attention_heads
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim or config.head_dim
        v_dim = config.v_head_dim or config.head_dim
        return cls(
            dense_bytes=dense,
            expert_bytes=expert_total // num_experts,
            num_moe_layers=len(moe_layers),
            num_local_experts=moe_layers[0].num_local_experts if moe_layers else 0,
            top_k=config.num_experts_per_tok,
            dense_params=dense // itemsize - lm_head,
            expert_params=expert_total // num_experts // itemsize,
            lm_head_params=lm_head,
            kv_bytes_per_token=model.kv_cache_bytes_per_token(dtype),
            attention_flops_per_context_token=2
            * heads
            * (qk_dim + v_dim)
            * config.num_hidden_layers,
        )

    def experts_touched(self, num_tokens: int) -> float:
        """Expected distinct local experts per MoE layer that ``num_tokens`` tokens route to."""
        e = self.num_local_experts
        return e * (1 - (1 - min(self.top_k, e) / e) ** num_tokens) if e else 0.0

    def bytes_read(self, num_tokens: int, context_lens: list[int]) -> float:
        """Bytes a step of ``num_tokens`` tokens over requests of ``context_lens`` (tokens cached
        or computed this step, per request) must move at least once."""
        experts = self.num_moe_layers * self.experts_touched(num_tokens) * self.expert_bytes
        return (
            self.dense_bytes + experts + self.kv_bytes_per_token * (sum(context_lens) + num_tokens)
        )

    def matmul_flops(self, num_tokens: int, num_sampled: int, attended: int) -> float:
        """Matrix FLOPs of a step: ``attended`` is the sum over query rows of their context."""
        per_token = self.dense_params + self.num_moe_layers * self.top_k * self.expert_params
        return (
            2 * per_token * num_tokens
            + 2 * self.lm_head_params * num_sampled
            + self.attention_flops_per_context_token * attended
        )


@dataclass(slots=True)
class _Totals:
    num_steps: int = 0
    seconds: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWork:
    """What one step computes, taken from its ``SchedulerOutput`` when it is scheduled (the
    requests' counts move on when the step's tokens are applied)."""

    kind: str  # "decode" (decode-only) or "prefill"
    num_tokens: int
    contexts: tuple[int, ...]  # tokens cached before the step, per scheduled request
    attended: int  # sum over query rows of the context each attends to
    num_sampled: int  # rows whose next token is sampled

    @classmethod
    def of(cls, scheduler_output) -> StepWork:
        contexts, attended, num_sampled = [], 0, 0
        for item in scheduler_output.scheduled:
            computed, new = item.request.num_computed_tokens, item.num_new_tokens
            contexts.append(computed)
            # query row j of the new tokens attends to computed + j + 1 tokens
            attended += new * computed + new * (new + 1) // 2
            num_sampled += computed + new >= item.request.num_tokens
        return cls(
            kind="decode" if scheduler_output.is_decode_only else "prefill",
            num_tokens=scheduler_output.num_tokens,
            contexts=tuple(contexts),
            attended=attended,
            num_sampled=num_sampled,
        )


@dataclass(slots=True)
class StepRoofline:
    """Per step kind (``decode``: decode-only, else ``prefill``), the measured step time against
    the bytes and FLOPs the step needs; ``attach`` times an engine's whole steps."""

    traffic: ModelTraffic
    bandwidth: float  # bytes/s
    peak: float  # FLOP/s
    totals: dict[str, _Totals] = field(default_factory=dict)

    def attach(self, engine, synchronize: Callable[[], None]) -> None:
        """Time every ``engine.step`` whole: scheduling, the model runner's step (inputs, the
        DP vote, the forward, sampling and the read-back of the tokens), the scheduler's update
        with the sampled tokens and the release of finished requests; add each step that ran the
        model on scheduled requests to the totals (``synchronize`` waits for the device at its
        end)."""
        scheduler, runner, step = engine.scheduler, engine.model_runner, engine.step
        schedule, execute = scheduler.schedule, runner.execute_model
        current: dict = {}

        def recording_schedule():
            out = schedule()
            current["work"] = StepWork.of(out) if out.scheduled else None
            return out

        def recording_execute(scheduler_output):
            out = execute(scheduler_output)
            current["ran_model"] = out.ran_model
            return out

        def timed_step():
            current.clear()
            start = time.perf_counter()
            result = step()
            synchronize()
            seconds = time.perf_counter() - start
            if current.get("work") is not None and current.get("ran_model"):
                self.add_work(current["work"], seconds)
            return result

        scheduler.schedule = recording_schedule
        runner.execute_model = recording_execute
        engine.step = timed_step

    def add(self, scheduler_output, seconds: float) -> None:
        """One step of ``scheduler_output`` (``SchedulerOutput``, before its tokens are applied)
        that took ``seconds``."""
        self.add_work(StepWork.of(scheduler_output), seconds)

    def add_work(self, work: StepWork, seconds: float) -> None:
        """One step that computed ``work`` in ``seconds``."""
        totals = self.totals.setdefault(work.kind, _Totals())
        totals.num_steps += 1
        totals.seconds += seconds
        totals.bytes += self.traffic.bytes_read(work.num_tokens, list(work.contexts))
        totals.flops += self.traffic.matmul_flops(work.num_tokens, work.num_sampled, work.attended)

    def lines(self) -> list[str]:
        """One line per step kind: mean step time, memory-roofline time and fraction, FLOP
        fraction of the matmul peak."""
        out = [
            f"roofline: copy bandwidth {self.bandwidth / 1e9:.1f} GB/s, matmul peak "
            f"{self.peak / 1e12:.2f} TFLOP/s"
        ]
        for kind, t in sorted(self.totals.items()):
            step_ms = 1e3 * t.seconds / t.num_steps
            roof_ms = 1e3 * t.bytes / self.bandwidth / t.num_steps
            out.append(
                f"roofline {kind}: {t.num_steps} steps, {step_ms:.3f} ms/step, "
                f"{t.bytes / t.num_steps / 2**20:.1f} MiB read/step -> memory roofline "
                f"{roof_ms:.3f} ms ({roof_ms / step_ms:.1%} of it), "
                f"{t.flops / t.seconds / 1e12:.3f} TFLOP/s ({t.flops / t.seconds / self.peak:.1%} "
                "of the matmul peak)"
            )
        return out
