"""What a callable dispatches: the ATen ops (views not counted: they launch nothing on a device)
and the Triton launches of the experts' kernels (``moe.fused_moe.triton_experts.launch``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCount:
    """ATen op names in dispatch order (views left out) and the number of Triton launches."""

    aten_ops: tuple[str, ...]
    triton_launches: int

    @property
    def num_aten_ops(self) -> int:
        return len(self.aten_ops)


class CountOps(TorchDispatchMode):
    """The ATen ops dispatched while active (``ops``: their names), views excluded (they launch
    nothing on a device)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> OpCount:
    """Run ``fn()`` and count what it dispatches. Triton launches are counted, not run (under the
    interpreter a launch would run ATen ops of its own): their outputs are left as allocated."""
    from moe.fused_moe import triton_experts

    launches = []
    with pytest.MonkeyPatch.context() as patch, CountOps() as mode:
        patch.setattr(triton_experts, "launch", lambda kernel, grid, *a, **k: launches.append(1))
        fn()
    return OpCount(aten_ops=tuple(mode.ops), triton_launches=len(launches))
