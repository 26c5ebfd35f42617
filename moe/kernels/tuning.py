"""Where our compiled CPU kernels beat the library path they replace, measured once per machine
(``measure_max_rows``) and kept beside the kernel build (``tuned_max_rows``). Why and how:
docs/hardware.md, "Kernel cuts: measured per machine"."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

MEASURE_REPEATS = 5  # each time is the best of this many calls, after one untimed call
# the kernel keeps a row count where its time is within this fraction above the other path's, and
# a loss is measured this many times more before it stands (``kernel_keeps``)
MEASURE_TOLERANCE = 0.05
MEASURE_CONFIRMATIONS = 1
MEASURE_MAX_ROWS = 1024  # the largest row count a measurement times
# the multiply-adds of a measurement's largest call (~10 ms on one core): each caller turns it
# into its own row bound (``measure_max_rows``' max_rows)
MEASURE_MAX_MACS = 1 << 28
TUNING_FILE = "tuning.json"  # beside the kernel build: {key: rows}
# variables that cap a library's ISA: a measurement under a cap holds only under that cap
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_max_rows: dict[str, float] = {}  # this process's answers, by the full key
# case -> (rows, seconds spent measuring it in this process, or None where it was read)
_looked_up: dict[str, tuple[float, float | None]] = {}


def best_seconds(fn: Callable[[], object], repeats: int = MEASURE_REPEATS) -> float:
    """The shortest wall time of ``repeats`` calls of ``fn`` in seconds, after one untimed call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_max_rows(
    seconds: Callable[[bool, int], float], max_rows: int, *, first: int = 1
) -> float:
    """The largest row count r of ``first``, 2 ``first``, 4 ``first``, ... at which the kernel
    (``seconds(True, r)``) was not beaten by the other path (``seconds(False, r)``,
    ``kernel_keeps``); 0 if it lost at the first count, ``inf`` if it won at every count measured:
    up to ``max_rows`` (the caller's cost bound; at least the first count, at most
    ``MEASURE_MAX_ROWS``)."""
    rows, won = first, 0.0
    while rows == first or rows <= min(max_rows, MEASURE_MAX_ROWS):
        if not kernel_keeps(seconds, rows):
            return won
        won, rows = float(rows), rows * 2
    return math.inf


def kernel_keeps(seconds: Callable[[bool, int], float], rows: int) -> bool:
    """Whether the kernel keeps ``rows``: it took at most ``1 + MEASURE_TOLERANCE`` times the
    other path's time, in the first measurement or in the ``MEASURE_CONFIRMATIONS`` that a loss
    gets before it stands: a cut stops the search, so one noisy pair would hand every larger count
    to the other path (docs/hardware.md, "Experts")."""
    for _ in range(1 + MEASURE_CONFIRMATIONS):
        if seconds(True, rows) <= seconds(False, rows) * (1 + MEASURE_TOLERANCE):
            return True
    return False


def tuning_path(kernels: ModuleType) -> Path:
    """The tuning file of a kernel build (``moe.kernels.cpu_kernels``): in its directory."""
    return Path(kernels.__file__).parent / TUNING_FILE


def tuned_max_rows(kernels: ModuleType, case: str, measure: Callable[[], float]) -> float:
    """The rows up to which ``kernels`` serve ``case`` (what is measured, with its dtype and
    shape, e.g. ``"experts torch.bfloat16 H=2048 F=1408"``): ``measure()`` (``measure_max_rows``)
    once per machine, kept by its key (the case, the thread count, the CPU model, the build's ISA
    and the ISA caps) in ``tuning_path``. An unreadable or unwritable file only costs the
    measurement. Thread-safe.
    """
    from moe.platforms.plugins import current_platform

    cap = current_platform().cpu_capability()
    caps = " ".join(f"{name}={os.environ.get(name, '')}" for name in ISA_CAP_VARIABLES)
    key = (
        f"{case} threads={torch.get_num_threads()} cpu={cap.model_name} "
        f"torch_isa={cap.torch_capability} kernel_isa={kernels.isa()} {caps}"
    )
    with _lock:
        if key not in _max_rows:
            path = tuning_path(kernels)
            stored, seconds = _read(path), None
            if not isinstance(stored.get(key), int | float):
                start = time.perf_counter()
                rows = measure()
                seconds = time.perf_counter() - start
                logger.info("moe-dbo: measured %s: up to %s rows (%.2f s)", case, rows, seconds)
                stored = {**_read(path), key: rows}  # read again: another rank may have written
                _write(path, stored)
            _max_rows[key] = float(stored[key])
            _looked_up[case] = (_max_rows[key], seconds)
        return _max_rows[key]


def describe() -> str | None:
    """A start-up line naming every cut this process looked up, e.g. ``"CPU kernel cuts (rows up
    to which our kernels run; measured in 0.4 s, kept beside the kernel build): experts
    torch.bfloat16 H=1024 F=2048: 4; attention ...: all"``; None if it looked up none."""
    with _lock:
        if not _looked_up:
            return None
        measured = [seconds for _, seconds in _looked_up.values() if seconds is not None]
        cuts = "; ".join(
            f"{case}: {'all' if math.isinf(rows) else int(rows)}"
            for case, (rows, _) in sorted(_looked_up.items())
        )
    how = f"measured in {sum(measured):.1f} s" if measured else "measured on an earlier start"
    return (
        f"CPU kernel cuts (rows up to which our kernels run; {how}, kept in {TUNING_FILE} beside "
        f"the kernel build): {cuts}"
    )


def _read(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _write(path: Path, stored: dict) -> None:
    """Write ``stored`` whole under a temporary name, then rename it: a reader (another rank)
    sees the old file or the new one, never a part."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        temporary.write_text(json.dumps(stored, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
