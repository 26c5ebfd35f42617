"""The engine of one DP rank: model, KV cache, scheduler and model runner, stepped in DP lockstep.

All DP ranks call ``step`` together: the model runner's DP vote is a collective, and the expert
all-to-all inside the model is one too. The loop ends on every rank at the same step, the first
one at which no DP rank has work.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dbo import TimelineRecorder, set_timeline_recorder
from dbo.timeline.recorder import timeline_step
from distributed import EmulatedLink, make_prepare_finalize
from launch.engine.arg_utils import EngineArgs
from launch.engine.embedded import EMBEDDED_MODEL_CONFIG, synthetic_prompts
from launch.engine.graph_mode import build_graph_mode
from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.kv_cache_sizing import KVCacheSizing, device_memory_budget, size_kv_cache
from launch.engine.model_runner import ModelRunner
from launch.engine.profile_run import profile_run
from launch.engine.profiler import make_step_profiler, step_annotation
from launch.engine.request import Request
from launch.engine.scheduler import Scheduler
from launch.engine.startup import freeze_gc_heap
from moe import (
    MoEModelConfig,
    build_model,
    check_checkpoint,
    config_parameter_bytes,
    init_random_weights,
    load_checkpoint,
    load_config,
    parameter_bytes,
    set_custom_ops,
)
from moe.kernels import tuning as kernel_tuning
from moe.layers.attention_backend import AttentionBackendEnum
from moe.layers.attention_selector import set_attention_backend
from moe.platforms.plugins import current_platform, load_general_plugins


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedModel:
    """The model to serve, resolved and checked before any process group exists."""

    config: MoEModelConfig
    checkpoint_dir: str | None  # None: the embedded default with seeded random weights
    max_model_len: int
    seed: int

    def synthetic_prompts(self) -> list[list[int]]:
        return synthetic_prompts(seed=self.seed, vocab_size=self.config.vocab_size)


def resolve_model(args: EngineArgs) -> ResolvedModel:
    """Read and check ``--model`` (config.json and safetensors headers; with ``--load-format
    dummy`` config.json or a preset name alone) or take the embedded default.

    Raises:
        ValueError: unsupported architecture (naming the supported ones), a malformed config, or
            ``--max-model-len`` beyond the model's ``max_position_embeddings``.
        OSError: a missing or unreadable checkpoint directory or file.
    """
    if args.model is None:
        config = MoEModelConfig.from_hf_config(EMBEDDED_MODEL_CONFIG)
    elif args.load_format == "dummy":  # config.json (or a preset) only: seeded random weights
        config = _dummy_config(args.model)
    else:
        if not Path(args.model).is_dir():
            raise FileNotFoundError(f"--model {args.model!r}: no such checkpoint directory")
        config = check_checkpoint(args.model)  # parses config.json and safetensors headers
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    return ResolvedModel(
        config=config, checkpoint_dir=args.model, max_model_len=max_model_len, seed=args.seed
    )


def check_parameter_memory(
    args: EngineArgs, config: MoEModelConfig, *, ep_size: int, dtype, available_bytes: int
) -> None:
    """Refuse a model whose parameters on one rank (its share of the routed experts, in
    ``dtype``: ``moe.config_parameter_bytes``, the start-up memory line's count) exceed
    ``available_bytes`` (the platform's ``available_memory`` of the rank's device), before
    anything is allocated.

    Raises:
        ValueError: one line naming the bytes needed, the config's sizes and the bytes available.
    """
    need = sum(config_parameter_bytes(config, ep_size=ep_size, dtype=dtype).values())
    if need <= available_bytes:
        return
    if args.model is None:
        what, source = "the embedded model", "embedded config"
    else:
        what = "--load-format dummy" if args.load_format == "dummy" else f"--model {args.model}"
        source = "config.json" if Path(args.model).is_dir() else f"preset {args.model}"
    sizes = (
        f"{config.num_experts} experts over {ep_size} EP rank(s), {config.num_hidden_layers} "
        f"layers, hidden_size {config.hidden_size}, vocab_size {config.vocab_size}; "
        f"{str(dtype).removeprefix('torch.')}"
    )
    raise ValueError(
        f"{what}: the parameters need {format_bytes(need)} per rank ({source}: {sizes}), more "
        f"than the {format_bytes(available_bytes)} available"
    )


def format_bytes(num_bytes: int) -> str:
    """``3.7 TiB``, ``22.1 GiB``, ``12.0 MiB`` (binary units, one decimal)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def _dummy_config(model: str) -> MoEModelConfig:
    """``--model``'s config under ``--load-format dummy``: a directory's ``config.json``, else a
    preset's (``launch.plan``'s, e.g. ``OLMoE-1B-7B``: shapes without a download).

    Raises:
        FileNotFoundError: neither a directory nor a preset name (the presets are listed).
    """
    if Path(model).is_dir():
        return load_config(model)
    from launch.planning.model_presets import PRESETS, config_from_hf

    preset = PRESETS.get(model.lower())
    if preset is None:
        names = sorted(p.name for p in PRESETS.values())
        raise FileNotFoundError(
            f"--model {model!r}: no such checkpoint directory, nor a preset ({names}) for "
            "--load-format dummy"
        )
    return config_from_hf(preset.hf_config)


def init_parallel_groups(args: EngineArgs):
    """This rank's ``distributed.ParallelGroups`` for ``args``, on the device and process-group
    backend the platform places this rank on (collective: every rank calls it; see
    ``distributed.init_distributed``).

    Raises:
        ValueError: before any process group exists, if the platform cannot place this rank
            (e.g. more ranks on the node than GPUs without ``--share-gpus``) or the torchrun
            environment is bad.
    """
    from distributed import TorchrunEnv, init_distributed

    env = TorchrunEnv.from_environ()
    placement = current_platform().place_rank(
        local_rank=env.local_rank,
        local_world_size=env.num_local_ranks,
        share_devices=args.share_gpus,
    )
    if placement.is_shared and env.rank == 0:
        print(
            f"moe-dbo: {placement.num_ranks_on_device} ranks share {placement.device}: process "
            "groups on gloo, transfers staged through host memory",
            file=sys.stderr,
            flush=True,
        )
    timeout = datetime.timedelta(seconds=args.distributed_timeout_s)
    return init_distributed(
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        timeout_s=args.distributed_timeout_s,
        backend=placement.dist_backend,
        device=placement.device,
        env=env,
        num_ranks_on_device=placement.num_ranks_on_device,
        # the platform's transport: shared memory between the ranks of a node on the CPU
        make_communicator=functools.partial(
            current_platform().make_communicator, env=env, timeout=timeout
        ),
    )


def single_rank_groups(args: EngineArgs):
    """The groups of an engine that runs alone without torchrun, on the platform's device."""
    from distributed import single_process_groups

    placement = current_platform().place_rank()
    return single_process_groups(args.distributed_timeout_s, placement.device)


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


def _make_all2all_backend(engine_args: EngineArgs, groups, config: MoEModelConfig):
    """The expert all-to-all backend over ``groups.ep_group`` (None without expert parallelism),
    behind an emulated link when ``--emulate-link`` is given.

    Raises:
        ValueError: under DBO, more ubatches than the backend can have in flight.
    """
    link_spec = engine_args.link_spec()
    if groups.ep_size == 1:
        return None
    backend = make_prepare_finalize(
        engine_args.all2all_backend,
        ep_group=groups.ep_comm,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        num_experts=config.num_experts,
        timeout=groups.timeout,
        # DeepEP's buffers: no step (microbatched or not) has more rows per rank than the
        # scheduler's token budget, so a low-latency dispatch never overflows its slots
        hidden_size=config.hidden_size,
        num_max_dispatch_tokens_per_rank=engine_args.max_num_batched_tokens,
    )
    if link_spec is not None:
        backend = backend.with_link(EmulatedLink(link_spec))
    if engine_args.enable_dbo:
        check_num_ubatches(backend, engine_args.num_ubatches)
    return backend


def check_num_ubatches(backend, num_ubatches: int) -> None:
    """Raise ValueError if ``backend`` (a ``FusedMoEPrepareAndFinalize`` or None) cannot have
    ``num_ubatches`` ubatches' transfers in flight at once (its ``max_num_ubatches``)."""
    limit = None if backend is None else backend.max_num_ubatches
    if limit is not None and num_ubatches > limit:
        raise ValueError(
            f"--ubatch-size {num_ubatches}: {backend.name} ({backend.implementation}) holds at "
            f"most {limit} ubatches' results at a time; use --ubatch-size <= {limit} or another "
            "--all2all-backend"
        )


class LLMEngine:
    """One DP rank's engine. ``groups`` is this process's ``distributed.ParallelGroups``."""

    def __init__(self, *, engine_args: EngineArgs, model: ResolvedModel, groups) -> None:
        self.args = engine_args
        self.groups = groups
        self.stats = EngineStats()
        self.timeline: TimelineRecorder | None = None
        if engine_args.timeline_dir:
            self.start_timeline()
        platform = current_platform()
        # armed by start_profile; None without --profiler-config
        self.profiler = make_step_profiler(
            engine_args.profiler(), rank=groups.rank, platform=platform
        )
        dtype = self._compute_dtype(platform)
        # before any allocation: a config too large for this rank's memory fails in seconds
        check_parameter_memory(
            engine_args,
            model.config,
            ep_size=groups.ep_size,
            dtype=dtype,
            available_bytes=platform.available_memory(groups.device),
        )
        self.prepare_finalize = _make_all2all_backend(engine_args, groups, model.config)
        self.model = self._build_model(model.config, dtype)
        self.max_num_blocks_per_req = math.ceil(model.max_model_len / engine_args.block_size)
        # On a device that reports its memory and without a KV flag, the cache gets what the
        # weights and a profile step leave (sized after the load); otherwise it is sized before
        # the checkpoint load: a budget too small for one request fails in seconds.
        sizes_from_memory = (
            engine_args.num_gpu_blocks_override is None
            and engine_args.kv_cache_memory_bytes is None
            and platform.device_memory(groups.device) is not None
        )
        if not sizes_from_memory:
            self.kv_cache_sizing = self._size_kv_cache(dtype, model.max_model_len)
            self._log(self.kv_cache_sizing.summary())
        if model.checkpoint_dir is None or engine_args.load_format == "dummy":
            # dummy weights (real shapes, e.g. 30B parameters) are drawn on the device; the
            # embedded default's on the host, alike on every device
            is_dummy = engine_args.load_format == "dummy"
            init_random_weights(self.model, seed=engine_args.seed, on_device=is_dummy)
        else:
            load_checkpoint(self.model, model.checkpoint_dir)
        if sizes_from_memory:
            self.kv_cache_sizing = self._size_kv_cache_from_memory(
                platform, dtype, model.max_model_len
            )
            self._log(self.kv_cache_sizing.summary())
        self._allocate_kv_cache(dtype)
        self.scheduler = Scheduler(
            kv_cache_manager=self.kv_cache_manager,
            max_num_seqs=engine_args.max_num_seqs,
            max_num_batched_tokens=engine_args.max_num_batched_tokens,
            max_model_len=model.max_model_len,
            eos_token_ids=model.config.eos_token_ids,
        )
        self.model_runner = self._build_model_runner(platform)
        cuts = kernel_tuning.describe()  # measured (first start) at the load and the KV binding
        if cuts is not None:
            self._log(cuts)
        freeze_gc_heap()  # the start-up heap is static from here on (vLLM's EngineCore does this)

    def _size_kv_cache(
        self, dtype, max_model_len: int, device_budget: tuple[int, str] | None = None
    ) -> KVCacheSizing:
        """``size_kv_cache`` for this engine's model and flags (ValueError as it raises)."""
        args = self.args
        return size_kv_cache(
            bytes_per_token=self.model.kv_cache_bytes_per_token(dtype),
            block_size=args.block_size,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            device_budget=device_budget,
        )

    def _size_kv_cache_from_memory(self, platform, dtype, max_model_len: int) -> KVCacheSizing:
        """The profile step at ``--max-num-batched-tokens`` (``profile_run``), then the sizing
        from ``--gpu-memory-utilization`` of the device's memory minus what is in use.

        Raises:
            ValueError: no memory left, or not enough for one request (``size_kv_cache``).
        """
        args, device = self.args, self.groups.device
        platform.reset_peak_memory(device)
        profile_run(
            self.model,
            num_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            dtype=dtype,
            groups=self.groups,
        )
        budget = device_memory_budget(
            platform.device_memory(device),
            gpu_memory_utilization=args.gpu_memory_utilization,
            profile_num_tokens=args.max_num_batched_tokens,
            num_ranks_on_device=self.groups.num_ranks_on_device,
        )
        return self._size_kv_cache(dtype, max_model_len, device_budget=budget)

    def _build_model(self, config: MoEModelConfig, dtype):
        """The model of ``config`` in ``dtype`` with this rank's experts, over the all-to-all
        backend (weights not loaded yet)."""
        # plugins may register out-of-tree ops; both must precede the build (ops bind at build)
        load_general_plugins()
        set_custom_ops(self.args.custom_ops)
        set_attention_backend(AttentionBackendEnum(self.args.attention_backend))
        return build_model(
            config,
            ep_rank=self.groups.ep_rank,
            ep_size=self.groups.ep_size,
            prepare_finalize=self.prepare_finalize,
            dtype=dtype,
            device=self.groups.device,
        )

    def _build_model_runner(self, platform) -> ModelRunner:
        """The platform's kernels prepared, graph mode built (``self.graph_stats``) and the
        model runner over the (compiled or eager) model."""
        # the platform's kernels (ours on a CPU: built on a machine's first start for its ISA,
        # then loaded from torch's cache), before the first step
        kernels = platform.prepare_kernels()
        if kernels is not None:
            self._log(kernels)
        # graph mode (when EngineArgs.graph_capture_sizes has buckets): compiled pieces per bucket
        runner_model, self.graph_stats = build_graph_mode(
            self.model,
            self.args,
            show_progress=self.groups.rank == 0,
            max_num_blocks_per_req=self.max_num_blocks_per_req,
            device=self.groups.device,
        )
        return ModelRunner(
            model=runner_model,
            kv_cache_manager=self.kv_cache_manager,
            engine_args=self.args,
            groups=self.groups,
            max_num_blocks_per_req=self.max_num_blocks_per_req,
        )

    def _log(self, line: str) -> None:
        """One start-up line on stderr, from rank 0 only."""
        if self.groups.rank == 0:
            print(f"moe-dbo: {line}", file=sys.stderr, flush=True)

    def _compute_dtype(self, platform):
        """The torch dtype the model runs in (the platform's answer for ``--dtype``); logs the
        platform, its config notes and why the dtype differs from the request, if it does."""
        chosen = self.args.compute_dtype()
        self._log(platform.describe())
        self._log(f"device {platform.describe_device(self.groups.device)}")
        self._log(f"attention backend {self.args.attention_backend}")
        if self.groups.dp_comm is not None:
            self._log(f"collectives over {self.groups.dp_comm.backend}")
        for note in self.args.platform_notes:
            self._log(note)
        if chosen.reason is not None:
            as_name = str(chosen.dtype).removeprefix("torch.")
            self._log(f"--dtype {self.args.dtype} runs as {as_name}: {chosen.reason}")
        return chosen.dtype

    def _allocate_kv_cache(self, dtype) -> None:
        """The KV cache of ``kv_cache_sizing`` in ``dtype``, its manager and the memory stats."""
        num_blocks, block_size = self.kv_cache_sizing.num_blocks, self.args.block_size
        kv_caches = self.model.allocate_kv_caches(
            num_blocks=num_blocks, block_size=block_size, dtype=dtype
        )
        self.memory = MemoryStats(
            parameter_bytes=parameter_bytes(self.model),
            kv_cache_bytes=sum(c.numel() * c.element_size() for c in kv_caches),
            kv_bytes_per_token=self.model.kv_cache_bytes_per_token(dtype),
            num_kv_slots=num_blocks * block_size,
            block_size=block_size,
        )
        self.kv_cache_manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)

    def all2all_summary(self) -> str:
        """Which expert all-to-all runs, and on what (e.g. ``deepep_low_latency (torch.distributed
        emulation of DeepEP's protocol)``); ``none`` without expert parallelism."""
        backend = self.prepare_finalize
        if backend is None:
            return "none (no expert parallelism)"
        return f"{backend.name} ({backend.implementation})"

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    @property
    def running_requests(self) -> tuple[Request, ...]:
        """This rank's running requests (scheduled in the last step or about to be), in order."""
        return tuple(self.scheduler.running)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of this rank's KV cache blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        kv = self.kv_cache_manager
        return 1.0 - kv.num_free_blocks / kv.num_blocks

    def abort_request(self, request_id: int) -> Request | None:
        """Drop a request of this rank (its blocks and sampling state); None if not here."""
        self.model_runner.release(request_id)
        return self.scheduler.abort_request(request_id)

    def step(self) -> tuple[list[Request], bool]:
        """Run one lockstep step; return (requests finished now, whether any DP rank had work)."""
        with timeline_step(self.stats.num_steps) as step_args:
            scheduler_output = self.scheduler.schedule()
            with step_annotation(scheduler_output.scheduled):
                out = self.model_runner.execute_model(scheduler_output)
            step_args.update(
                num_tokens=out.num_tokens,
                num_tokens_padded=out.num_tokens_padded,
                is_ubatched=out.is_ubatched,
                num_ubatches=out.num_ubatches,
                ran_model=out.ran_model,
            )
            if out.adaptive is not None:  # marks exploration steps in the timeline
                step_args.update(
                    dbo_policy="explore" if out.adaptive.is_exploring else "exploit",
                    dbo_bucket=out.adaptive.bucket.label,
                )
        if not any(out.has_work_across_dp):
            return [], False
        if self.profiler is not None:  # counts the same steps on every DP rank
            self.profiler.step()
        if out.ran_model:
            self.stats.num_steps += 1
            self.stats.num_ubatched_steps += out.is_ubatched
            self.stats.num_dbo_exploration_steps += (
                out.adaptive is not None and out.adaptive.is_exploring
            )
        self.stats.num_preemptions += len(scheduler_output.preempted)
        finished = self.scheduler.update_from_output(
            scheduler_output, out.sampled_token_ids, out.failed_request_ids
        )
        if out.sampled_logprobs:
            by_id = {s.request.request_id: s.request for s in scheduler_output.scheduled}
            for request_id, logprobs in out.sampled_logprobs.items():
                by_id[request_id].output_logprobs.append(logprobs)
        for request in finished:
            self.model_runner.release(request.request_id)
        return finished, True

    def run_until_done(self) -> list[Request]:
        """Step until no DP rank has work; return this rank's finished requests."""
        finished: list[Request] = []
        while True:
            done_now, any_work = self.step()
            finished += done_now
            if not any_work:
                return finished

    def dbo_crossover_tokens(self) -> dict[str, float]:
        """Per kind with an ``auto`` threshold ("decode" / "prefill"): the tokens per rank from
        which the adaptive policy found microbatching to pay (``inf`` never, ``nan`` not yet
        known); identical on every DP rank."""
        policy = self.model_runner.adaptive_policy
        return {
            kind: policy.crossover_tokens(kind) for kind in sorted(self.args.adaptive_dbo_kinds)
        }

    def dbo_summary(self) -> str:
        """One line for the summary: the learned crossover per adaptive kind (empty if none)."""
        from dbo import format_crossover

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
            self.timeline = TimelineRecorder(
                rank=self.groups.rank,
                device_clock=current_platform().device_clock(self.groups.device),
            )
            set_timeline_recorder(self.timeline)
        return self.timeline

    def write_timeline(self) -> str | None:
        """Write this rank's Chrome trace to ``--timeline-dir``; return its path (None if off)."""
        if self.timeline is None or not self.args.timeline_dir:
            return None
        os.makedirs(self.args.timeline_dir, exist_ok=True)
        path = os.path.join(self.args.timeline_dir, f"rank{self.groups.rank}.json")
        self.timeline.write_chrome_trace(path)
        set_timeline_recorder(None)
        return path
