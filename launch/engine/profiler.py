"""Step profiling of every rank, vLLM's ``--profiler-config``: the config (``ProfilerConfig``) and
a window over engine steps recorded by torch's profiler or a device profiler's range
(``StepProfiler``). How to use it: docs/profiling.md#torchprofiler-traces---profiler-config; the
design: docs/profiling.md#step-profiler-config-and-windows."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace

from dbo.timeline.recorder import torch_profiler_on
from moe.flag_json import parse_json_object

PROFILER_KINDS = ("torch", "cuda")
# vLLM's older switch: a torch profiler writing here when no --profiler-config is given
PROFILER_DIR_VARIABLE = "VLLM_TORCH_PROFILER_DIR"
TABLE_ROWS = 50  # rows of the op table a rank writes (vLLM's CPU-only table has 50)
PROFILE_PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # start_profile's trace-name prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilerConfig:
    """vLLM's ``ProfilerConfig``, the keys moe-dbo runs (same names and defaults)."""

    profiler: str | None = None  # "torch" | "cuda" | None (off)
    torch_profiler_dir: str = ""  # where each rank writes its trace (made absolute)
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True  # the op table sorted by device time
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    delay_iterations: int = 0  # engine steps after start_profile before recording
    max_iterations: int = 0  # recorded steps before stopping by itself (0: until stop_profile)

    @property
    def is_on(self) -> bool:
        return self.profiler is not None


def profiler_config(text: str | None) -> ProfilerConfig:
    """The profiler of ``--profiler-config`` (``text``), else of ``$VLLM_TORCH_PROFILER_DIR``
    (vLLM's variable before the flag: ``{"profiler": "torch", "torch_profiler_dir": it}``), else
    none. Raises ValueError as ``parse_profiler_config``."""
    if text is not None:
        return parse_profiler_config(text)
    directory = os.environ.get(PROFILER_DIR_VARIABLE)
    if directory:
        from_variable = {"profiler": "torch", "torch_profiler_dir": directory}
        return parse_profiler_config(json.dumps(from_variable))
    return ProfilerConfig()


def parse_profiler_config(text: str) -> ProfilerConfig:
    """``--profiler-config`` JSON -> ``ProfilerConfig``, ``torch_profiler_dir`` made absolute.

    Raises:
        ValueError: not a JSON object, a key ``ProfilerConfig`` lacks (naming the supported
            ones), a value of the wrong type or a negative count, a ``profiler`` outside
            ``PROFILER_KINDS``, ``"torch"`` without ``torch_profiler_dir`` or a directory with
            another profiler (vLLM's rules).
    """
    flag = "--profiler-config"
    known = {f.name: f for f in fields(ProfilerConfig)}
    raw = parse_json_object(flag, text, known)
    for key, value in raw.items():
        _check_value(key, value, known[key].type)
    config = ProfilerConfig(**raw)
    if config.profiler is not None and config.profiler not in PROFILER_KINDS:
        raise ValueError(
            f"{flag} profiler {config.profiler!r} is not one of {list(PROFILER_KINDS)}"
        )
    if config.profiler == "torch" and not config.torch_profiler_dir:
        raise ValueError(f'{flag}: "torch" needs "torch_profiler_dir" (where traces go)')
    if config.torch_profiler_dir and config.profiler != "torch":
        raise ValueError(f'{flag}: "torch_profiler_dir" applies only to profiler "torch"')
    if config.torch_profiler_dir:
        absolute = os.path.abspath(os.path.expanduser(config.torch_profiler_dir))
        config = replace(config, torch_profiler_dir=absolute)
    return config


def _check_value(key: str, value, annotation: str) -> None:
    """ValueError naming ``key`` unless ``value`` fits the field's ``annotation``."""
    if annotation == "bool":
        ok = isinstance(value, bool)
    elif annotation == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:  # "str" or "str | None"
        ok = isinstance(value, str) or (value is None and "None" in annotation)
    if not ok:
        kind = "an integer >= 0" if annotation == "int" else annotation
        raise ValueError(f"--profiler-config {key}={value!r} must be {kind}")


class StepProfiler:
    """One rank's profiling window over engine steps: ``start`` arms it (recording at once, or
    after ``delay_iterations`` steps), ``step`` after every engine step, ``stop`` ends it and
    writes what was recorded. Subclasses record (``_begin`` / ``_end``); a second ``start``
    while armed, or a ``stop`` while not, does nothing (vLLM's behaviour)."""

    def __init__(self, config: ProfilerConfig, *, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.is_armed = False
        self.is_recording = False
        self._num_steps = 0  # steps since start
        self._num_recorded = 0
        self.prefix: str | None = None  # the trace names' prefix of this window

    def start(self, prefix: str | None = None) -> None:
        """Arm the window; ``prefix`` (``PROFILE_PREFIX``: letters, digits, ``_.-``) starts
        its trace names (vLLM's ``profile_prefix``).

        Raises:
            ValueError: a prefix that is not a plain file-name part, before anything starts.
        """
        if prefix is not None and not PROFILE_PREFIX.fullmatch(prefix):
            raise ValueError(
                f"profile prefix {prefix!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if self.is_armed:
            return
        self.is_armed, self._num_steps, self._num_recorded = True, 0, 0
        self.prefix = prefix
        if self.config.delay_iterations == 0:
            self._begin_recording()

    def step(self) -> None:
        """After an engine step in which some DP rank had work. Ending at ``max_iterations``
        never raises: a trace that cannot be written is reported on stderr (``stop`` raises)."""
        if not self.is_armed:
            return
        self._num_steps += 1
        if self.is_recording:
            self._num_recorded += 1
            if 0 < self.config.max_iterations <= self._num_recorded:
                try:
                    self._end_recording()
                except Exception as e:  # noqa: BLE001 - a lost trace must not end the engine
                    print(
                        f"moe-dbo: [rank {self.rank}] the profiler stopped after "
                        f"max_iterations but could not write: {type(e).__name__}: {e}",
                        file=sys.stderr,
                    )
        elif self._num_steps == self.config.delay_iterations:
            self._begin_recording()

    def stop(self) -> None:
        if not self.is_armed:
            return
        self.is_armed = False
        if self.is_recording:
            self._end_recording()

    def _begin_recording(self) -> None:
        self._begin()
        self.is_recording = True

    def _end_recording(self) -> None:
        self.is_recording = False
        self._end()

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError


class TorchStepProfiler(StepProfiler):
    """``torch.profiler`` over ``activities``; on stop, this rank's Chrome trace and op table in
    ``torch_profiler_dir``."""

    def __init__(self, config: ProfilerConfig, *, rank: int, activities: list) -> None:
        super().__init__(config, rank=rank)
        self.activities = activities
        self._profile = None

    def _begin(self) -> None:
        import torch

        c = self.config
        every_thread = all_threads_config()
        # With stacks, torch's Python tracer keeps frame names as pointers into code objects,
        # which dangle once code freed inside the window is collected (pytorch/pytorch#136040):
        # key_averages raised UnicodeDecodeError in 2-rank runs recording every thread (torch
        # 2.13 CPU, mostly the first window after start). Every thread's ops matter more than
        # the Python stacks.
        with_stack = c.torch_profiler_with_stack and every_thread is None
        if c.torch_profiler_with_stack and not with_stack and self.rank == 0:
            print(
                "moe-dbo: torch profiler records every thread (the ubatch threads); "
                "torch_profiler_with_stack is off with it",
                file=sys.stderr,
            )
        self._profile = torch.profiler.profile(
            activities=self.activities,
            record_shapes=c.torch_profiler_record_shapes,
            profile_memory=c.torch_profiler_with_memory,
            with_stack=with_stack,
            with_flops=c.torch_profiler_with_flops,
            experimental_config=every_thread,
        )
        self._profile.start()

    def _end(self) -> None:
        import torch

        profile, self._profile = self._profile, None
        profile.stop()
        directory = self.config.torch_profiler_dir
        os.makedirs(directory, exist_ok=True)
        suffix = ".gz" if self.config.torch_profiler_use_gzip else ""
        name = f"rank{self.rank}" if self.prefix is None else f"{self.prefix}_rank{self.rank}"
        trace = os.path.join(
            directory, f"{name}.{time.time_ns() // 1_000_000}.pt.trace.json{suffix}"
        )
        profile.export_chrome_trace(trace)
        by_device = torch.profiler.ProfilerActivity.CUDA in self.activities
        sort_by = (
            "self_cuda_time_total"
            if by_device and self.config.torch_profiler_dump_cuda_time_total
            else "self_cpu_time_total"
        )
        table = profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        table_path = os.path.join(directory, f"profiler_out_{self.rank}.txt")
        with open(table_path, "w", encoding="utf-8") as f:
            f.write(table + "\n")
        if self.rank == 0:
            print(f"moe-dbo: torch profiler wrote {trace} and {table_path}", file=sys.stderr)


def all_threads_config():
    """``torch.profiler``'s experimental config that records the ops of every thread (under DBO
    the forward runs on the ubatch threads, which the default, thread-local state misses), or
    None where this torch has no ``profile_all_threads`` (then only the thread that started the
    profiler is recorded; probed, not read from the version)."""
    import torch

    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


class RangeStepProfiler(StepProfiler):
    """A device profiler's capture range around the window (``begin`` / ``end``: e.g.
    ``cudaProfilerStart`` / ``Stop``); writes nothing itself."""

    def __init__(
        self,
        config: ProfilerConfig,
        *,
        rank: int,
        begin: Callable[[], None],
        end: Callable[[], None],
    ) -> None:
        super().__init__(config, rank=rank)
        self._device_begin, self._device_end = begin, end

    def _begin(self) -> None:
        self._device_begin()

    def _end(self) -> None:
        self._device_end()


def step_annotation(scheduled) -> AbstractContextManager:
    """While a torch profiler records, a range around a step's model execution named as vLLM's
    runner names it, ``execute_context_<prefill requests>(<their tokens>)_generation_<decode
    requests>(<their tokens>)`` (``scheduled``: the step's ``ScheduledRequest`` s), so tools
    that read vLLM traces find the steps' shapes; otherwise a no-op (one flag read)."""
    if not torch_profiler_on():
        return nullcontext()
    import torch

    decodes = [s.num_new_tokens for s in scheduled if s.is_decode]
    prefills = [s.num_new_tokens for s in scheduled if not s.is_decode]
    name = (
        f"execute_context_{len(prefills)}({sum(prefills)})"
        f"_generation_{len(decodes)}({sum(decodes)})"
    )
    return torch.profiler.record_function(name)


def make_step_profiler(config: ProfilerConfig, *, rank: int, platform) -> StepProfiler | None:
    """The profiler ``config`` names on ``platform`` for rank ``rank``, or None when off.

    Raises:
        ValueError: a ``"cuda"`` profiler on a platform without a device range.
    """
    if not config.is_on:
        return None
    refusal = check_profiler_kind(config, platform)
    if refusal is not None:
        raise ValueError(refusal)
    if config.profiler == "torch":
        activities = platform.profiler_activities()
        return TorchStepProfiler(config, rank=rank, activities=activities)
    begin, end = platform.profiler_range()
    return RangeStepProfiler(config, rank=rank, begin=begin, end=end)


def check_profiler_kind(config: ProfilerConfig, platform) -> str | None:
    """Why ``platform`` cannot run ``config``'s profiler, or None."""
    if config.is_on and config.profiler not in platform.profiler_kinds:
        return (
            f'--profiler-config profiler "{config.profiler}" needs a CUDA device range; platform '
            f'{platform.name} has none (use "torch")'
        )
    return None
