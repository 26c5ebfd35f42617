"""What one rank's engine tells about itself: step counts, memory, the step profiler
(``--profiler-config``), the timeline (``--timeline-dir``) and the summary lines the entry points
print.

The engine owns one ``EngineObservability`` (``LLMEngine.observability``) and reports each step to
it; the profiler's mechanism lives in ``launch.engine.profiler``, the timeline's in
``dbo.timeline``. docs/profiling.md shows how to read both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dbo import TimelineRecorder, format_crossover, set_timeline_recorder
from launch.engine.profiler import ProfilerConfig, make_step_profiler
from moe.models.causal_lm import parameter_bytes


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0  # steps in which this rank ran the model (real or dummy batch)
    num_ubatched_steps: int = 0
    num_preemptions: int = 0
    num_dbo_exploration_steps: int = 0  # steps the adaptive DBO policy spent exploring


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryStats:
    """This rank's memory: parameter bytes per category (``moe.PARAM_CATEGORIES``), the KV cache
    it allocated, and the KV bytes one token takes over all layers."""

    parameter_bytes: dict[str, int]
    kv_cache_bytes: int
    kv_bytes_per_token: int
    num_kv_slots: int
    block_size: int

    @classmethod
    def of(cls, model, kv_caches: list, *, dtype, num_blocks: int, block_size: int) -> MemoryStats:
        """The stats of ``model`` (an ``MoEForCausalLM``) and the KV cache tensors it allocated
        (``model.allocate_kv_caches``: ``num_blocks`` blocks of ``block_size`` tokens, in
        ``dtype``)."""
        return cls(
            parameter_bytes=parameter_bytes(model),
            kv_cache_bytes=sum(c.numel() * c.element_size() for c in kv_caches),
            kv_bytes_per_token=model.kv_cache_bytes_per_token(dtype),
            num_kv_slots=num_blocks * block_size,
            block_size=block_size,
        )

    def summary(self) -> str:
        mib = 1 << 20
        p = self.parameter_bytes
        parts = ", ".join(f"{k} {v / mib:.2f}" for k, v in p.items() if v)
        return (
            f"params {sum(p.values()) / mib:.2f} MiB per rank ({parts}); "
            f"KV cache {self.kv_cache_bytes / mib:.2f} MiB for {self.num_kv_slots} tokens "
            f"({self.num_kv_slots // self.block_size} blocks), "
            f"{self.kv_bytes_per_token} B/token"
        )


class EngineObservability:
    """One rank's engine seen from outside: ``stats`` (counted by ``record_step``), ``memory``,
    the step ``profiler`` (None without ``--profiler-config``), the ``timeline`` (None until
    ``start_timeline``; started at once with ``timeline_dir``) and the summary lines.

    Built first in the engine's start-up (a profiler the platform cannot run is refused before any
    allocation; the timeline records the start-up); ``bind`` hands it the parts the summaries
    read once the engine has built them.

    Raises:
        ValueError: a ``"cuda"`` profiler on a platform without a device range.
    """

    def __init__(
        self,
        *,
        rank: int,
        device,
        platform,
        profiler_config: ProfilerConfig,
        timeline_dir: str | None,
        adaptive_dbo_kinds: frozenset[str],
    ) -> None:
        self.rank = rank
        self.timeline_dir = timeline_dir
        self.adaptive_dbo_kinds = adaptive_dbo_kinds
        self._platform, self._device = platform, device
        self.stats = EngineStats()
        self.timeline: TimelineRecorder | None = None
        if timeline_dir:
            self.start_timeline()
        # armed by start_profile
        self.profiler = make_step_profiler(profiler_config, rank=rank, platform=platform)
        self.memory: MemoryStats | None = None  # the parts bind() hands over
        self.prepare_finalize = None
        self.adaptive_policy = None

    def bind(self, *, memory: MemoryStats, prepare_finalize, adaptive_policy) -> None:
        """The engine's parts, once built: its memory, its expert all-to-all (None without
        expert parallelism) and the model runner's ``dbo.AdaptiveDBOPolicy``."""
        self.memory = memory
        self.prepare_finalize = prepare_finalize
        self.adaptive_policy = adaptive_policy

    def record_step(self, out, *, num_preemptions: int) -> None:
        """After a step in which some DP rank had work (``out``: the model runner's
        ``StepOutput``; ``num_preemptions``: requests the scheduler preempted in it)."""
        if self.profiler is not None:  # counts the same steps on every DP rank
            self.profiler.step()
        if out.ran_model:
            self.stats.num_steps += 1
            self.stats.num_ubatched_steps += out.is_ubatched
            self.stats.num_dbo_exploration_steps += (
                out.adaptive is not None and out.adaptive.is_exploring
            )
        self.stats.num_preemptions += num_preemptions

    def all2all_summary(self) -> str:
        """Which expert all-to-all runs, and on what (e.g. ``deepep_low_latency (torch.distributed
        emulation of DeepEP's protocol)``); ``none`` without expert parallelism."""
        backend = self.prepare_finalize
        if backend is None:
            return "none (no expert parallelism)"
        return f"{backend.name} ({backend.implementation})"

    def dbo_crossover_tokens(self) -> dict[str, float]:
        """Per kind with an ``auto`` threshold ("decode" / "prefill"): the tokens per rank from
        which the adaptive policy found microbatching to pay (``inf`` never, ``nan`` not yet
        known); identical on every DP rank."""
        policy = self.adaptive_policy
        return {kind: policy.crossover_tokens(kind) for kind in sorted(self.adaptive_dbo_kinds)}

    def dbo_summary(self) -> str:
        """One line for the summary: the learned crossover per adaptive kind (empty if none)."""
        crossover = self.dbo_crossover_tokens()
        if not crossover:
            return ""
        parts = ", ".join(f"{kind} {format_crossover(v)}" for kind, v in crossover.items())
        return (
            f"adaptive DBO crossover: {parts} "
            f"({self.stats.num_dbo_exploration_steps} exploration steps)"
        )

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start this rank's profiler (``--profiler-config``): it records from the next step (or
        after its ``delay_iterations``) until ``stop_profile`` or its ``max_iterations``; a start
        while it is on does nothing. ``profile_prefix``: the trace is named
        ``<prefix>_rank<r>.<ms>.pt.trace.json[.gz]`` instead of ``rank<r>.…``.

        Raises:
            RuntimeError: the engine was built without ``--profiler-config``.
            ValueError: a prefix other than letters, digits, ``_``, ``.``, ``-`` (1-64).
        """
        if self.profiler is None:
            raise RuntimeError(
                "profiling is off: start the engine with --profiler-config "
                '\'{"profiler": "torch", "torch_profiler_dir": DIR}\' (LLM(profiler_config=...))'
            )
        self.profiler.start(profile_prefix)

    def stop_profile(self) -> None:
        """Stop this rank's profiler and write what it recorded (``torch``: the rank's trace and
        op table in ``torch_profiler_dir``); nothing when it is not on."""
        if self.profiler is not None:
            self.profiler.stop()

    def start_timeline(self) -> TimelineRecorder:
        """Record a timeline from now on (spans of every step, for ``write_timeline`` or for
        in-process metrics); idempotent. Entry points other than generate (serve, bench) use it."""
        if self.timeline is None:
            device_clock = self._platform.device_clock(self._device)
            self.timeline = TimelineRecorder(rank=self.rank, device_clock=device_clock)
            set_timeline_recorder(self.timeline)
        return self.timeline

    def write_timeline(self) -> str | None:
        """Write this rank's Chrome trace to ``--timeline-dir``; return its path (None if off)."""
        if self.timeline is None or not self.timeline_dir:
            return None
        os.makedirs(self.timeline_dir, exist_ok=True)
        path = os.path.join(self.timeline_dir, f"rank{self.rank}.json")
        self.timeline.write_chrome_trace(path)
        set_timeline_recorder(None)
        return path


def timeline_step_args(out) -> dict:
    """The step span's args of a step that returned ``out`` (``StepOutput``): its token
    counts and ubatching, and with the adaptive policy whether it explored and in which bucket."""
    args = {
        "num_tokens": out.num_tokens,
        "num_tokens_padded": out.num_tokens_padded,
        "is_ubatched": out.is_ubatched,
        "num_ubatches": out.num_ubatches,
        "ran_model": out.ran_model,
    }
    if out.adaptive is not None:  # marks exploration steps in the timeline
        args["dbo_policy"] = "explore" if out.adaptive.is_exploring else "exploit"
        args["dbo_bucket"] = out.adaptive.bucket.label
    return args
