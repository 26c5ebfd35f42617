"""Start-up of graph mode for an engine: pick the backend, point inductor's cache at our directory,
compile/capture every bucket with a progress bar (``moe.compilation.GraphModeModel``).

Cache: inductor's FX graph cache and its compiled C++ live in ``TORCHINDUCTOR_CACHE_DIR``; when the
variable is unset the engine sets it to ``$XDG_CACHE_HOME/moe-dbo/inductor`` (default
``~/.cache/moe-dbo/inductor``), so a second start with the same shapes loads instead of compiling.
The graphs take the weights as inputs, so the cache key holds shapes and dtypes, not weight values.
Either way the graphs live in a subdirectory per CPU capability (``cpu-avx512``, ``cpu-avx2``, ...:
``cpu_cache_subdir``): inductor's cache key does not hold ATen's dispatch level, and a graph
compiled under one (an AVX-512 run) returned wrong values when loaded under another
(``ATEN_CPU_CAPABILITY=avx2``), as a cache shared by machines of two ISAs would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch import nn

from launch.engine.arg_utils import EngineArgs
from moe.compilation import CaptureStats, GraphModeModel
from moe.platforms import current_platform


def cpu_cache_subdir() -> str:
    """The cache subdirectory of this CPU capability: ``cpu-<torch's dispatch level>-<our ISA>``,
    e.g. ``cpu-avx512-avx512`` (the platform's ``cpu_capability()``)."""
    capability = current_platform().cpu_capability()
    return f"cpu-{capability.torch_capability.lower()}-{capability.isa}"


def graph_cache_dir() -> str:
    """``TORCHINDUCTOR_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/moe-dbo/inductor``, with this
    CPU capability's subdirectory (``cpu_cache_subdir``) appended unless it ends with it."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(home) / "moe-dbo" / "inductor")
    subdir = cpu_cache_subdir()
    return base if Path(base).name == subdir else str(Path(base) / subdir)


def build_graph_mode(
    model: nn.Module, args: EngineArgs, *, show_progress: bool
) -> tuple[nn.Module, CaptureStats | None]:
    """``(GraphModeModel over model, its capture stats)``, or ``(model, None)`` when graph mode is
    off (``--enforce-eager``), the platform has no graph backend, or the backend cannot run here
    (a note on stderr).

    Compiles at start-up only; a forward above the largest bucket later runs eagerly."""
    capture_sizes = args.graph_capture_sizes()
    if not capture_sizes:
        return model, None
    backend = current_platform().graph_backend()
    if backend is None:  # check_and_update_config turns graph mode off there; a direct call
        return model, None
    reason = backend.unavailable_reason()
    if reason is not None:
        sys.stderr.write(f"{reason}: running eagerly\n")
        return model, None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = graph_cache_dir()  # read by inductor only
    graph_model = GraphModeModel(model, capture_sizes, backend=backend)
    stats = graph_model.capture(progress=show_progress)
    return graph_model, stats
