"""What the GPU tests share: a built-in platform for one test (or CUDA's with a fake device count),
a rank's groups where a platform places it, and the matrix products a callable runs on the
host."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = frozenset(
    f"aten::{op}" for op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm")
)


def fake_cuda_platform(device_count: int):
    """``CudaPlatform`` seeing ``device_count`` devices, for its device-selection logic alone
    (callers stub ``torch.cuda.set_device``)."""
    from moe.platforms import CudaPlatform

    class FakeCudaPlatform(CudaPlatform):
        def device_count(self) -> int:
            return device_count

    return FakeCudaPlatform()


def builtin_platform(device_type: str):
    """A new instance of the built-in platform of ``device_type`` ("cpu" or "cuda")."""
    from moe.platforms.plugins import BUILTIN_PLATFORMS

    return BUILTIN_PLATFORMS[device_type]()


@contextlib.contextmanager
def device_platform(device_type: str = "cuda") -> Iterator[None]:
    """The built-in platform of ``device_type`` current for the duration (the suite pins the CPU
    one: ``tests/conftest.py``)."""
    from moe.platforms import set_current_platform

    set_current_platform(builtin_platform(device_type))
    try:
        yield
    finally:
        set_current_platform(None)


def placed_groups(platform, rank: int, world_size: int, *, timeout_s: float):
    """This rank's groups (DP = EP = ``world_size``) where ``platform``, made current, places it;
    ranks share devices where there are fewer than ranks (one GPU: gloo through the host)."""
    from distributed import init_distributed
    from moe.platforms import set_current_platform

    set_current_platform(platform)
    placement = platform.place_rank(
        local_rank=rank, local_world_size=world_size, share_devices=True
    )
    groups = init_distributed(
        data_parallel_size=world_size,
        enable_expert_parallel=True,
        timeout_s=timeout_s,
        backend=placement.dist_backend,
        device=placement.device,
        num_ranks_on_device=placement.num_ranks_on_device,
    )
    return placement, groups


def _is_host_matmul(name: str, args, kwargs) -> bool:
    if name not in _MATMULS and "mkldnn" not in name and "onednn" not in name:
        return False
    tensors = torch.utils._pytree.tree_leaves((args, kwargs))
    return any(isinstance(t, torch.Tensor) and t.is_cpu for t in tensors)


class _RecordOps(TorchDispatchMode):
    """The ATen op names dispatched while active, of the calls ``keep(name, args, kwargs)``
    accepts."""

    def __init__(self, keep: Callable[[str, tuple, dict], bool]):
        super().__init__()
        self.keep = keep
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if self.keep(name, args, kwargs or {}):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def host_matmuls(fn: Callable[[], object]) -> list[str]:
    """The matrix-product ops ``fn()`` ran with an operand in host memory (ATen op names)."""
    with _RecordOps(_is_host_matmul) as mode:
        fn()
    return mode.calls


def attention_ops(fn: Callable[[], object]) -> list[str]:
    """The ATen attention ops ``fn()`` ran (SDPA's backend kernels: flash, efficient, cuDNN, math
    or the CPU's), in order."""
    with _RecordOps(lambda name, *_: "attention" in name) as mode:
        fn()
    return mode.calls
