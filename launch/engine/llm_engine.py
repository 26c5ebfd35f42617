"""The engine of one DP rank: the step loop over its model, KV cache, scheduler and model runner.

All DP ranks call ``step`` together: the model runner's DP vote is a collective, and the expert
all-to-all inside the model is one too. The loop ends on every rank at the same step, the first
one at which no DP rank has work. Start-up steps live in ``launch.engine.startup`` and
``launch.engine.kv_cache_sizing``; what the engine reports (stats, memory, profiler, timeline) in
``launch.engine.observability`` (``LLMEngine.observability``).
"""

from __future__ import annotations

import math

from dbo.timeline.recorder import timeline_step
from distributed.all2all.ep_backend import maybe_make_prepare_finalize
from launch.engine.arg_utils import EngineArgs
from launch.engine.graph_mode import build_graph_mode
from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.kv_cache_sizing import (
    KVCacheSizing,
    size_engine_kv_cache,
    size_kv_cache_from_memory,
    sizes_from_device_memory,
)
from launch.engine.model_runner import ModelRunner
from launch.engine.observability import EngineObservability, MemoryStats, timeline_step_args
from launch.engine.profiler import step_annotation
from launch.engine.request import Request
from launch.engine.scheduler import Scheduler
from launch.engine.startup import (
    build_rank_model,
    freeze_gc_heap,
    log_startup,
    select_compute_dtype,
)
from moe.kernels import tuning as kernel_tuning
from moe.model_loader import ResolvedModel, check_parameter_memory, load_weights
from moe.platforms.plugins import current_platform


class LLMEngine:
    """One DP rank's engine. ``model``: the model to serve (``EngineArgs.resolve_model``);
    ``groups``: this process's ``distributed.ParallelGroups``.

    Raises:
        ValueError: at start-up, before the allocation it concerns: parameters beyond the
            device's memory, a KV cache budget below one request, more ubatches than the
            all-to-all keeps in flight, a profiler the platform cannot run.
    """

    def __init__(self, *, engine_args: EngineArgs, model: ResolvedModel, groups) -> None:
        self.args = engine_args
        self.groups = groups
        platform = current_platform()
        self.observability = EngineObservability(
            rank=groups.rank,
            device=groups.device,
            platform=platform,
            profiler_config=engine_args.profiler(),
            timeline_dir=engine_args.timeline_dir,
            adaptive_dbo_kinds=engine_args.adaptive_dbo_kinds,
        )
        dtype = select_compute_dtype(engine_args, platform, groups)
        # before any allocation: a config too large for this rank's memory fails in seconds
        check_parameter_memory(
            model,
            ep_size=groups.ep_size,
            dtype=dtype,
            available_bytes=platform.available_memory(groups.device),
        )
        self.prepare_finalize = maybe_make_prepare_finalize(
            engine_args.all2all_backend,
            groups,
            num_experts=model.config.num_experts,
            hidden_size=model.config.hidden_size,
            num_max_dispatch_tokens_per_rank=engine_args.max_num_batched_tokens,
            link_spec=engine_args.link_spec(),
            num_ubatches=engine_args.num_ubatches if engine_args.enable_dbo else None,
        )
        self.model = build_rank_model(
            engine_args,
            model.config,
            dtype=dtype,
            groups=groups,
            prepare_finalize=self.prepare_finalize,
        )
        self.max_num_blocks_per_req = math.ceil(model.max_model_len / engine_args.block_size)
        self.kv_cache_sizing = self._load_weights_and_size_kv_cache(model, platform, dtype)
        memory = self._allocate_kv_cache(dtype)
        self.scheduler = Scheduler(
            kv_cache_manager=self.kv_cache_manager,
            max_num_seqs=engine_args.max_num_seqs,
            max_num_batched_tokens=engine_args.max_num_batched_tokens,
            max_model_len=model.max_model_len,
            eos_token_ids=model.config.eos_token_ids,
        )
        self.model_runner = self._build_model_runner(platform)
        self.observability.bind(
            memory=memory,
            prepare_finalize=self.prepare_finalize,
            adaptive_policy=self.model_runner.adaptive_policy,
        )
        cuts = kernel_tuning.describe()  # measured (first start) at the load and the KV binding
        if cuts is not None:
            self._log(cuts)
        freeze_gc_heap()  # the start-up heap is static from here on (vLLM's EngineCore does this)

    def _load_weights_and_size_kv_cache(
        self, model: ResolvedModel, platform, dtype
    ) -> KVCacheSizing:
        """Load the weights and choose the KV cache's size: before the load from the flags or
        the host's budget (a budget too small for one request fails in seconds), after it from
        what the weights and a profile step leave of the device's memory (a device that reports
        its memory, no KV flag: ``sizes_from_device_memory``)."""
        args, max_model_len = self.args, model.max_model_len
        from_memory = sizes_from_device_memory(args, platform, self.groups.device)
        if not from_memory:
            sizing = size_engine_kv_cache(
                self.model, args, dtype=dtype, max_model_len=max_model_len
            )
            self._log(sizing.summary())
        load_weights(self.model, model)
        if from_memory:
            sizing = size_kv_cache_from_memory(
                self.model,
                args,
                groups=self.groups,
                platform=platform,
                dtype=dtype,
                max_model_len=max_model_len,
            )
            self._log(sizing.summary())
        return sizing

    def _allocate_kv_cache(self, dtype) -> MemoryStats:
        """The KV cache of ``kv_cache_sizing`` in ``dtype`` and its manager; the memory stats."""
        num_blocks, block_size = self.kv_cache_sizing.num_blocks, self.args.block_size
        kv_caches = self.model.allocate_kv_caches(
            num_blocks=num_blocks, block_size=block_size, dtype=dtype
        )
        self.kv_cache_manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
        return MemoryStats.of(
            self.model, kv_caches, dtype=dtype, num_blocks=num_blocks, block_size=block_size
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
        log_startup(self.groups.rank, line)

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
        with timeline_step(self.observability.stats.num_steps) as step_args:
            scheduler_output = self.scheduler.schedule()
            with step_annotation(scheduler_output.scheduled):
                out = self.model_runner.execute_model(scheduler_output)
            step_args.update(timeline_step_args(out))
        if not any(out.has_work_across_dp):
            return [], False
        self.observability.record_step(out, num_preemptions=len(scheduler_output.preempted))
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
