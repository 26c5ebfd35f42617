"""``Platform`` (after vLLM's ``vllm/platforms/interface.py``): one object per device family
answers every device question, so modules never test device strings; ``CpuPlatform``,
``CudaPlatform`` and the answers' dataclasses. Each question: docs/hardware.md, "The Platform's
questions"."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moe.platforms.cpu_capability import (
    CpuCapability,
    detect_cpu_capability,
    onednn_linear_unavailable_reason,
)
from moe.platforms.placement import RankPlacement, accelerator_index, host_placement

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dbo.timeline.device_clock import DeviceClock
    from distributed.communicator import Communicator
    from distributed.parallel_state import TorchrunEnv

HOST_TRANSPORT_VARIABLE = "MOE_DBO_HOST_TRANSPORT"
HOST_TRANSPORTS = ("shm", "gloo")


def host_transport() -> str:
    """How ranks of one node exchange on the CPU: ``MOE_DBO_HOST_TRANSPORT``, ``"shm"`` (shared
    memory, the default) or ``"gloo"``.

    Raises:
        ValueError: another value, naming the accepted ones.
    """
    value = os.environ.get(HOST_TRANSPORT_VARIABLE, "shm").strip().lower() or "shm"
    if value not in HOST_TRANSPORTS:
        raise ValueError(f"{HOST_TRANSPORT_VARIABLE}={value!r}: expected one of {HOST_TRANSPORTS}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeDtype:
    """The dtype a requested ``--dtype`` runs in, and why it differs (None when it does not)."""

    dtype: torch.dtype
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigUpdate:
    """What ``check_and_update_config`` changes: EngineArgs field -> new value, and one note per
    change for the start-up log."""

    changes: dict[str, Any]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """A device's memory in bytes, as vLLM's ``determine_available_memory`` reads it after a
    profile step: ``total_bytes``; ``not_torch_bytes``, everything on the device that is not this
    process's torch allocator (other processes, the CUDA context, NCCL buffers);
    ``torch_peak_bytes``, the allocator's peak since ``reset_peak_memory`` (the weights and the
    profile step's activations)."""

    total_bytes: int
    not_torch_bytes: int
    torch_peak_bytes: int

    @property
    def in_use_bytes(self) -> int:
        return self.not_torch_bytes + self.torch_peak_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Float32PackLimits:
    """Where a float32 GEMM uses a prepacked oneDNN weight (``moe.layers.linear``): batches of at
    most ``max_rows`` rows, weights of at least ``min_elements`` elements (per expert matrix)."""

    max_rows: int
    min_elements: int


class Platform:
    """A device family; the defaults are a plain-torch CPU-like device without kernels of its own.
    Subclass and override the answers that differ (see the module docstring)."""

    name: str = "unspecified"
    dispatch_key: str = "native"
    # what tensors on this platform's device are (``platform_for`` looks a device's platform up)
    device_type: str = "cpu"  # the torch device type this platform answers for
    # host memory: read without a device sync, drawn by host generators, taken by the host's
    # kernels (``moe.kernels``, oneDNN packs) and by host transports without staging
    is_host_memory: bool = True
    is_triton_target: bool = False  # Triton compiles kernels for its tensors (no interpreter)
    profiler_kinds: tuple[str, ...] = ("torch",)  # the ``--profiler-config`` profilers it runs
    issue_before_recv_hook: bool = True
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16)
    attention_backends: tuple[str, ...] = ("TORCH_SDPA",)
    graph_modes: tuple[str, ...] = ("NONE",)  # cudagraph_mode values, the graphs' choice first
    graphs_by_default: bool = False
    full_graph_attention_backends: tuple[str, ...] = ()
    # --all2all-backend under --enable-dbo when none is given: DeepEP's low-latency protocol reads
    # nothing on the host inside DBO's overlapped window (a host read is a device sync)
    dbo_all2all_backend: str = "deepep_low_latency"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dispatch_key={self.dispatch_key!r})"

    def cpu_capability(self) -> CpuCapability:
        """The host CPU's capability, detected on the first call (the host CPU runs the Python
        side on every platform)."""
        return _host_cpu_capability()

    def place_rank(
        self, *, local_rank: int = 0, local_world_size: int = 1, share_devices: bool = False
    ) -> RankPlacement:
        """Where rank ``local_rank`` of the ``local_world_size`` ranks of this node computes.

        Raises:
            ValueError: the node cannot host that many ranks (see ``placement``), naming why.
        """
        return host_placement()

    def synchronize(self, device: torch.device) -> None:
        """Block until the work enqueued on ``device`` is done (host-device synchronisation)."""

    def make_communicator(
        self, group: ProcessGroup, *, env: TorchrunEnv, timeout: datetime.timedelta
    ) -> Communicator:
        """The object that runs ``group``'s collectives; collective over ``group`` where a
        platform's answer is (every rank of a job runs one platform). Here torch.distributed's."""
        from distributed.communicator import Communicator

        return Communicator(group)

    def describe_device(self, device: torch.device) -> str:
        """The device for the start-up line, e.g. ``cpu`` or ``cuda:0 (NVIDIA H200, 139.8 GiB)``."""
        return str(device)

    def device_memory(self, device: torch.device) -> DeviceMemory | None:
        """``device``'s memory accounted after a profile step, for sizing the KV cache from it
        (``DeviceMemory``: total, other users, this allocator's peak), or None where the KV cache
        is not sized from memory (the host: ``launch.engine.kv_cache_sizing``'s fixed budget).
        Unlike ``available_memory``, it needs the allocator's peak, which only a device with its
        own allocator statistics has."""
        return None

    def reset_peak_memory(self, device: torch.device) -> None:
        """Start a new peak for ``device_memory``'s ``in_use_bytes`` (before the profile step)."""

    def make_ubatch_streams(self, num_ubatches: int, device: torch.device) -> list | None:
        """Per-ubatch streams and events on ``device`` (``dbo.cuda_streams.UBatchStreams``), or
        None where ops run in issue order."""
        return None

    def device_clock(self, device: torch.device) -> DeviceClock | None:
        """The clock that times the timeline's compute spans on ``device`` (``DeviceClock``), or
        None where ops run synchronously and the host spans already time them."""
        return None

    def graph_backend(self) -> type | None:
        """The graph-mode piece backend (``moe.compilation.backends``), or None (eager only)."""
        return None

    def pin_host_memory(self, device: torch.device) -> bool:
        """Whether host staging buffers of inputs for ``device`` are pinned (page-locked), so that
        their copies to it can be non-blocking: no here (the device is the host)."""
        return False

    def default_capture_sizes(
        self, max_capture_size: int | None, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> tuple[int, ...]:
        """The graph-mode buckets when none are given: the CPU's coarse ones
        (``moe.compilation.config.cpu_capture_sizes``: each graph costs a compilation)."""
        from moe.compilation.config import cpu_capture_sizes

        return cpu_capture_sizes(max_capture_size, max_num_batched_tokens=max_num_batched_tokens)

    def profiler_activities(self) -> list:
        """What ``torch.profiler`` records here (``ProfilerActivity`` list): the host's ops."""
        return [torch.profiler.ProfilerActivity.CPU]

    def profiler_range(self) -> tuple[Callable[[], None], Callable[[], None]] | None:
        """(start, stop) of a device profiler's capture range (``--profiler-config``'s
        ``"cuda"``), or None where there is none."""
        return None

    def prepare_kernels(self) -> str | None:
        """Build or load this platform's kernels now; the start-up line, or None if it has none."""
        return None

    def available_memory(self, device: torch.device) -> int:
        """Bytes that can be allocated on ``device`` now (here: the host's,
        ``host_available_memory``), for the checks that refuse a model too large before anything
        is allocated. Answered on every device, host included, before the model exists; the
        KV cache's sizing after the profile step reads ``device_memory`` instead."""
        return host_available_memory()

    def compute_dtype(self, dtype: torch.dtype) -> ComputeDtype:
        """The dtype ``dtype`` runs in here.

        Raises:
            ValueError: ``dtype`` is not in ``supported_dtypes``.
        """
        if dtype not in self.supported_dtypes:
            names = [str(d).removeprefix("torch.") for d in self.supported_dtypes]
            raise ValueError(
                f"--dtype {dtype} is not supported on {self.name}; choose one of {names}"
            )
        return ComputeDtype(dtype=dtype)

    def check_and_update_config(self, args: Any) -> ConfigUpdate:
        """Check ``args`` (an ``EngineArgs``) against this platform; the changes it needs (the
        default ``--attention-backend`` named, graph mode turned off where there is no graph
        backend).

        Raises:
            ValueError: a setting this platform cannot run (e.g. an unsupported ``--dtype`` or
                ``--attention-backend``), naming it and what is accepted.
        """
        from moe.layers.attention_backend import check_attention_backend

        self.compute_dtype(getattr(torch, args.dtype))  # raises for an unsupported dtype
        backend = check_attention_backend(
            args.attention_backend, self.attention_backends, block_size=args.block_size
        )
        changes: dict[str, Any] = {"attention_backend": backend.value}
        if self.graph_backend() is None and not args.enforce_eager:
            changes["enforce_eager"] = True
            changes["cudagraph_mode"] = "NONE"
            return ConfigUpdate(
                changes=changes,
                notes=(f"graph mode off: platform {self.name} has no graph backend",),
            )
        return ConfigUpdate(changes=changes)

    def describe(self) -> str:
        """One start-up line: the platform and, for the host CPU, its capability."""
        return f"platform {self.name}: {self.cpu_capability().describe()}"

    def float32_pack_limits(self) -> Float32PackLimits:
        """Where float32 GEMMs use a prepacked oneDNN weight (CPU platforms)."""
        return Float32PackLimits(max_rows=256, min_elements=1 << 20)


def host_available_memory() -> int:
    """Bytes the host can give this process now: ``MemAvailable`` (``/proc/meminfo``: free memory
    plus what the kernel can reclaim), capped by a cgroup v2 limit (``memory.max`` less
    ``memory.current``) where one is set; ``os.sysconf``'s free pages where there is no
    ``/proc``."""
    available = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    return available


@functools.cache
def _host_cpu_capability() -> CpuCapability:
    return detect_cpu_capability()


class CpuPlatform(Platform):
    """x86 (and other) CPUs: gloo, inductor graphs, our C++ kernels built for the detected ISA,
    oneDNN's prepacked GEMMs where a probe shows they run."""

    name = "cpu"
    dispatch_key = "cpu"
    issue_before_recv_hook = True
    # flex_attention on the CPU runs eagerly (a [heads, rows, cache tokens] score matrix) or
    # compiled per shape (inductor's CPU template fails to build with dynamic shapes)
    attention_backends = ("CPU_ATTN", "TORCH_SDPA")
    # inductor compiles pieces; the CPU attention plans read the metadata on the host. Off by
    # default: it did not pay end to end on CPUs (docs/benchmarks.md, "What was tried")
    graph_modes = ("PIECEWISE", "NONE")
    # host reads cost no sync here, and the plain all-to-all moves only the valid rows: it ran
    # the README's DBO job and the emulated-link benchmark faster than the low-latency emulation
    # (docs/backends.md, "The default under DBO")
    dbo_all2all_backend = "all_to_all"

    def graph_backend(self) -> type | None:
        from moe.compilation.backends import InductorGraph

        return InductorGraph

    def prepare_kernels(self) -> str | None:
        from moe.kernels import prepare_cpu_kernels  # builds C++: only when asked

        return f"CPU kernels {prepare_cpu_kernels(self.cpu_capability().isa)}"

    def make_communicator(
        self, group: ProcessGroup, *, env: TorchrunEnv, timeout: datetime.timedelta
    ) -> Communicator:
        """Shared memory between the group's ranks on one node (our C++ kernels' ``ShmComm``),
        gloo between nodes; gloo alone where the kernels did not build on some rank or
        ``MOE_DBO_HOST_TRANSPORT=gloo`` (logged). Collective over ``group``."""
        from distributed.shm_transport import create_communicator
        from moe.kernels import cpu_kernels  # builds C++: only when asked

        kernels = cpu_kernels(self.cpu_capability().isa) if host_transport() == "shm" else None
        return create_communicator(
            group, kernels=kernels, node_rank=env.node, job_id=env.job_id, timeout=timeout
        )

    def compute_dtype(self, dtype: torch.dtype) -> ComputeDtype:
        chosen = super().compute_dtype(dtype)
        if dtype != torch.bfloat16:
            return chosen
        reason = onednn_linear_unavailable_reason(torch.bfloat16)
        if reason is None:
            return chosen
        # Without bfloat16 GEMMs (AVX2-only CPUs) torch converts every bfloat16 operand on the fly,
        # and float32 runs faster (measured in docs/hardware.md).
        return ComputeDtype(
            dtype=torch.float32,
            reason=f"this CPU has no bfloat16 GEMM ({reason}); weights are upcast exactly at load",
        )

    @functools.cached_property
    def _float32_pack_limits(self) -> Float32PackLimits:
        # On Intel CPUs MKL's sgemm is as fast as the pack above 256 rows and oneDNN's per-call
        # cost dominates weights below 2^20 elements. Elsewhere MKL runs no AVX-512: on an
        # AVX-512 CPU it is about half oneDNN's speed, so the pack wins at every batch size from
        # 2^17 elements; on an AVX2-only one both run AVX2 and MKL is as fast or faster except for
        # large weights at a few dozen rows (docs/hardware.md, "Linear layers").
        capability = self.cpu_capability()
        if capability.vendor in ("GenuineIntel", "unknown"):
            return Float32PackLimits(max_rows=256, min_elements=1 << 20)
        if not capability.isa.startswith("avx512"):
            return Float32PackLimits(max_rows=64, min_elements=1 << 20)
        return Float32PackLimits(max_rows=sys.maxsize, min_elements=1 << 17)

    def float32_pack_limits(self) -> Float32PackLimits:
        return self._float32_pack_limits  # asked on every linear call: decided once


class CudaPlatform(Platform):
    """NVIDIA GPUs: a device per local rank (shared on request), NCCL (gloo when shared),
    per-ubatch CUDA streams and events, CUDA graphs, vLLM's transfer order."""

    name = "cuda"
    dispatch_key = "cuda"
    device_type = "cuda"
    is_host_memory = False
    is_triton_target = True
    profiler_kinds = ("torch", "cuda")  # "cuda": cudaProfilerStart / Stop (``profiler_range``)
    issue_before_recv_hook = False
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    # a launch costs the host more than a small decode step's kernels cost the device: graphs on
    # unless --enforce-eager (vLLM's default; 3.1x eager measured on an H200, docs/hardware.md)
    graph_modes = ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE")
    graphs_by_default = True
    # read the KV cache and every per-step value from device tensors, with no host read
    full_graph_attention_backends = ("TRITON_ATTN",)

    def default_capture_sizes(
        self, max_capture_size: int | None, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> tuple[int, ...]:
        """vLLM's buckets (``moe.compilation.config.vllm_capture_sizes``): up to
        ``min(512, max_num_seqs, max_num_batched_tokens)``, so every decode step has a graph."""
        from moe.compilation.config import vllm_capture_sizes

        return vllm_capture_sizes(
            max_capture_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )

    @property
    def attention_backends(self) -> tuple[str, ...]:
        """TRITON_ATTN first where Triton can launch its kernels (importable, and a CUDA device or
        Triton's interpreter), then the padded SDPA chunks and flex_attention."""
        from moe.platforms.triton_probe import triton_unavailable_reason

        fallback = ("TORCH_SDPA", "FLEX_ATTENTION")
        return fallback if triton_unavailable_reason() else ("TRITON_ATTN", *fallback)

    def device_count(self) -> int:
        """Visible CUDA devices (tests override it to drive ``place_rank``)."""
        return torch.cuda.device_count()

    def place_rank(
        self, *, local_rank: int = 0, local_world_size: int = 1, share_devices: bool = False
    ) -> RankPlacement:
        index, num_on_device = accelerator_index(
            local_rank=local_rank,
            local_world_size=local_world_size,
            device_count=self.device_count(),
            share_devices=share_devices,
        )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        return RankPlacement(
            device=device,
            # NCCL refuses two ranks on one device: shared devices talk over gloo via the host
            dist_backend="gloo" if num_on_device > 1 else "nccl",
            num_ranks_on_device=num_on_device,
        )

    def describe_device(self, device: torch.device) -> str:
        if device.type != "cuda":
            return str(device)
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":  # host tensors of a CUDA process: nothing enqueued
            torch.cuda.synchronize(device)

    def pin_host_memory(self, device: torch.device) -> bool:
        # an unpinned source makes cudaMemcpyAsync copy through a staging buffer and block
        return device.type == "cuda"

    def available_memory(self, device: torch.device) -> int:
        if device.type != "cuda":
            return super().available_memory(device)
        free, _total = torch.cuda.mem_get_info(device)  # free on the device, other processes' use
        return free

    def device_memory(self, device: torch.device) -> DeviceMemory | None:
        if device.type != "cuda":  # host tensors of a CUDA process: the host's sizing
            return None
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(
            total_bytes=total,
            not_torch_bytes=(total - free) - torch.cuda.memory_reserved(device),
            torch_peak_bytes=torch.cuda.max_memory_allocated(device),
        )

    def reset_peak_memory(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def make_ubatch_streams(self, num_ubatches: int, device: torch.device) -> list | None:
        if device.type != "cuda":  # host tensors of a CUDA process: ops run in issue order
            return None
        from dbo.cuda_streams import make_ubatch_streams

        return make_ubatch_streams(num_ubatches, device)

    def device_clock(self, device: torch.device) -> DeviceClock | None:
        from dbo.timeline.device_clock import CudaDeviceClock

        # kernels run asynchronously: a host span times their launch, CUDA events their run
        return CudaDeviceClock(device) if device.type == "cuda" else None

    def graph_backend(self) -> type | None:
        from moe.compilation.backends import CUDAGraphPiece

        return CUDAGraphPiece

    def profiler_activities(self) -> list:
        activity = torch.profiler.ProfilerActivity
        return [activity.CPU, activity.CUDA]

    def profiler_range(self) -> tuple[Callable[[], None], Callable[[], None]] | None:
        # cudaProfilerStart / Stop: what `nsys profile --capture-range=cudaProfilerApi` waits for
        return torch.cuda.profiler.start, torch.cuda.profiler.stop

    def prepare_kernels(self) -> str | None:
        """Take cuDNN's fused attention out of torch's SDPA choice, for the whole process (torch's
        backend flags are process-wide); the start-up line, or None where this torch has no such
        flag. cuDNN builds an execution graph per input shape (hundreds of milliseconds each:
        sglang#4650, pytorch#155958), and the padded attention chunks change shape every decode
        step; flash and memory-efficient attention take the same inputs with no per-shape build."""
        if not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            return None
        torch.backends.cuda.enable_cudnn_sdp(False)
        return "SDPA backends: flash, memory-efficient, math (cuDNN's builds a graph per shape)"
