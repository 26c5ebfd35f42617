"""The timing loop the micro-benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable


def mean_seconds(fn: Callable, *args, repeats: int) -> float:
    """Mean wall time of ``fn(*args)`` in seconds over ``repeats`` calls, after one untimed call
    (warm-up: allocations, oneDNN primitive creation)."""
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats
