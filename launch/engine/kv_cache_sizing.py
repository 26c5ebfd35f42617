"""How many KV cache blocks a rank allocates: a memory budget, as vLLM sizes it (the override, the
flag, a device's free memory after a profile step, or the host's default), capped and checked
against the engine's limits. The order of the rules: docs/models.md#kv-cache-sizing-the-order;
why the host's default is fixed: docs/models.md#kv-cache-size."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from launch.engine.profile_run import profile_run
from moe.platforms import DeviceMemory

GIB = 1 << 30
DEFAULT_KV_CACHE_MEMORY_BYTES = 4 * GIB
KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB, vLLM's CPU backend (legacy)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheSizing:
    """The chosen cache: ``num_blocks`` blocks of ``block_size`` tokens, ``block_bytes`` each (all
    layers), and what decided it (``source``: the flag, the env or the default)."""

    num_blocks: int
    block_size: int
    block_bytes: int
    source: str

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def summary(self) -> str:
        return (
            f"KV cache {self.num_blocks} blocks x {self.block_size} tokens "
            f"({self.num_bytes / GIB:.3f} GiB per rank, {self.block_bytes} B/block; {self.source})"
        )


def device_memory_budget(
    memory: DeviceMemory,
    *,
    gpu_memory_utilization: float,
    profile_num_tokens: int,
    num_ranks_on_device: int = 1,
) -> tuple[int, str]:
    """(budget in bytes, how it was derived): ``gpu_memory_utilization`` of the device's total
    memory minus what is in use after the profile step of ``profile_num_tokens`` tokens. With
    ``num_ranks_on_device`` > 1 ranks sharing the device, each takes its 1/n of that fraction minus
    its own allocator's peak only (the others' memory is in their own shares; the CUDA contexts
    fit in the rest of the device).

    Raises:
        ValueError: if nothing is left (the message names the numbers and the flags to change).
    """
    requested = int(gpu_memory_utilization * memory.total_bytes) // num_ranks_on_device
    share = f"{gpu_memory_utilization:.2f} x {memory.total_bytes / GIB:.1f} GiB"
    if num_ranks_on_device == 1:
        in_use, what = memory.in_use_bytes, "in use"
    else:
        share += f" / {num_ranks_on_device} ranks on the device"
        in_use, what = memory.torch_peak_bytes, "this rank's peak"
    budget = requested - in_use
    source = (
        f"{share} - {in_use / GIB:.1f} GiB {what} after a profile step at "
        f"{profile_num_tokens} tokens"
    )
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {source} leaves {budget / GIB:.2f} GiB; raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or give "
            "--kv-cache-memory-bytes"
        )
    return budget, source


def kv_cache_budget(
    kv_cache_memory_bytes: int | None,
    environ: Mapping[str, str] | None = None,
    device_budget: tuple[int, str] | None = None,
) -> tuple[int, str]:
    """(budget in bytes, where it came from): the flag, else ``device_budget`` (the
    ``device_memory_budget`` of a device), else ``VLLM_CPU_KVCACHE_SPACE`` (GiB), else the default.

    Raises:
        ValueError: a ``VLLM_CPU_KVCACHE_SPACE`` that is not a positive integer.
    """
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, f"--kv-cache-memory-bytes {kv_cache_memory_bytes}"
    if device_budget is not None:
        return device_budget
    environ = os.environ if environ is None else environ
    text = environ.get(KVCACHE_SPACE_ENV, "")
    if text.strip():
        try:
            gib = int(text)
        except ValueError:
            gib = 0
        if gib < 1:
            raise ValueError(f"{KVCACHE_SPACE_ENV} must be a positive integer (GiB), got {text!r}")
        return gib * GIB, f"{KVCACHE_SPACE_ENV}={gib} GiB"
    return DEFAULT_KV_CACHE_MEMORY_BYTES, "default budget 4 GiB (--kv-cache-memory-bytes)"


def size_kv_cache(
    *,
    bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_gpu_blocks_override: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
    device_budget: tuple[int, str] | None = None,
) -> KVCacheSizing:
    """The number of blocks this rank allocates (see the module docstring).

    Args:
        bytes_per_token: KV bytes of one token over all layers (``model.kv_cache_bytes_per_token``).
        block_size, max_model_len, max_num_seqs: the engine's.
        num_gpu_blocks_override, kv_cache_memory_bytes: the flags (None: not given).
        environ: where to read ``VLLM_CPU_KVCACHE_SPACE`` (default ``os.environ``).
        device_budget: ``device_memory_budget``'s result on a device (None on the host).

    Raises:
        ValueError: the budget cannot hold one request of ``max_model_len`` tokens (the message
            names the budget, the need and the flags to change), or a bad env value.
    """
    block_bytes = bytes_per_token * block_size
    if num_gpu_blocks_override is not None:
        return KVCacheSizing(
            num_blocks=num_gpu_blocks_override,
            block_size=block_size,
            block_bytes=block_bytes,
            source=f"--num-gpu-blocks-override {num_gpu_blocks_override}",
        )
    budget, source = kv_cache_budget(kv_cache_memory_bytes, environ, device_budget)
    blocks_per_request = math.ceil(max_model_len / block_size)
    num_blocks = budget // block_bytes
    if num_blocks < blocks_per_request:
        need = blocks_per_request * block_bytes
        raise ValueError(
            f"the KV cache budget ({source}: {budget} bytes = {budget / GIB:.3f} GiB) holds "
            f"{num_blocks} blocks of {block_size} tokens ({block_bytes} bytes each), but one "
            f"request of max_model_len={max_model_len} tokens needs {blocks_per_request} blocks "
            f"({need} bytes = {need / GIB:.3f} GiB); raise --kv-cache-memory-bytes"
            f"{' or --gpu-memory-utilization' if device_budget else ''} or lower --max-model-len"
        )
    usable = max_num_seqs * blocks_per_request
    if num_blocks > usable:
        num_blocks = usable
        source += f"; capped at --max-num-seqs {max_num_seqs} full-length requests"
    return KVCacheSizing(
        num_blocks=num_blocks, block_size=block_size, block_bytes=block_bytes, source=source
    )


def sizes_from_device_memory(args, platform, device) -> bool:
    """Whether ``args`` (``EngineArgs``) leave the cache to what the weights and a profile step
    leave of ``device``'s memory: no KV flag, and ``platform`` reports the device's memory (a
    GPU). Then the cache is sized after the load; otherwise before it, so that a budget too small
    for one request fails in seconds."""
    return (
        args.num_gpu_blocks_override is None
        and args.kv_cache_memory_bytes is None
        and platform.device_memory(device) is not None
    )


def size_engine_kv_cache(
    model, args, *, dtype, max_model_len: int, device_budget: tuple[int, str] | None = None
) -> KVCacheSizing:
    """``size_kv_cache`` for ``model`` (an ``MoEForCausalLM`` whose cache is in ``dtype``) and
    the flags of ``args`` (``EngineArgs``). Raises ValueError as ``size_kv_cache``."""
    return size_kv_cache(
        bytes_per_token=model.kv_cache_bytes_per_token(dtype),
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        device_budget=device_budget,
    )


def size_kv_cache_from_memory(
    model, args, *, groups, platform, dtype, max_model_len: int
) -> KVCacheSizing:
    """The profile step at ``--max-num-batched-tokens`` (``profile_run``, collective over EP),
    then the sizing from ``--gpu-memory-utilization`` of the device's memory minus what is in use
    (``groups``: the rank's ``distributed.ParallelGroups``; ``platform`` reads the memory).

    Raises:
        ValueError: no memory left, or not enough for one request (``size_kv_cache``).
    """
    device = groups.device
    platform.reset_peak_memory(device)
    profile_run(
        model,
        num_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        dtype=dtype,
        groups=groups,
    )
    budget = device_memory_budget(
        platform.device_memory(device),
        gpu_memory_utilization=args.gpu_memory_utilization,
        profile_num_tokens=args.max_num_batched_tokens,
        num_ranks_on_device=groups.num_ranks_on_device,
    )
    return size_engine_kv_cache(
        model, args, dtype=dtype, max_model_len=max_model_len, device_budget=budget
    )
