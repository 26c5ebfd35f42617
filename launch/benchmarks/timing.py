"""The timing loops the micro-benchmarks share, and the switch for our compiled CPU kernels."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator


def mean_seconds(fn: Callable, *args, repeats: int) -> float:
    """Mean wall time of ``fn(*args)`` in seconds over ``repeats`` calls, after one untimed call
    (warm-up: allocations, oneDNN primitive creation)."""
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def device_timer(device, repeats: int) -> Callable[..., float]:
    """``mean_seconds`` with ``repeats`` that also waits for ``device``'s work after each call
    (the current platform's ``synchronize``: a no-op where ops are synchronous)."""
    from moe.platforms import current_platform

    synchronize = current_platform().synchronize

    def timed(fn: Callable, *args) -> float:
        return mean_seconds(lambda *a: (fn(*a), synchronize(device)), *args, repeats=repeats)

    return timed


@contextlib.contextmanager
def compiled_kernels(enabled: bool) -> Iterator[None]:
    """Our compiled CPU kernels on or off (``MOE_DBO_CPU_KERNELS``, read at each call) inside the
    block; the variable's previous value is restored after it."""
    old = os.environ.get("MOE_DBO_CPU_KERNELS")
    os.environ["MOE_DBO_CPU_KERNELS"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MOE_DBO_CPU_KERNELS"]
        else:
            os.environ["MOE_DBO_CPU_KERNELS"] = old
