"""Our C++ CPU kernels, compiled on first use for the machine at hand.

``cpu_kernels()`` builds ``csrc/*.cpp`` with ``torch.utils.cpp_extension.load`` (ninja + the
system C++ compiler, ``-O3 -march=native``: the code is compiled for the CPU it runs on, so one
binary never meets another CPU's instruction set) and returns the loaded module, or ``None`` when
it cannot be built here (no compiler, no ninja, a compile error): the callers then keep their plain
torch path, which computes the same result. The build lands in torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), in a directory named by a hash
of the sources, their directory, the flags and torch's and Python's versions (two checkouts never
overwrite each other's build), so only the first start on a machine pays for it (~20 s on 2
cores); later starts load it in well under a second. ``MOE_DBO_CPU_KERNELS=0`` turns the kernels
off (the plain path runs).

Kernels (the module's functions):
    paged_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc, req_ids, scale)
        Attention that reads K/V in place in the paged cache (``csrc/paged_attention_cpu.cpp``;
        used by ``moe.layers.batched_attention.batched_paged_attention``). ``query`` and ``out``
        ``[num_tokens, num_heads, head_dim]`` and ``kv_cache`` ``[2, num_blocks, block_size,
        num_kv_heads, head_dim]``, contiguous, one dtype (float32, float64 or bfloat16);
        ``block_table`` ``[num_reqs, max_blocks]``, ``seq_lens`` ``[num_reqs]`` and
        ``query_start_loc`` ``[num_reqs + 1]`` int32; ``req_ids`` ``[n]`` int64, the requests to
        compute; ``scale`` the softmax scale. Writes the query rows of those requests into
        ``out`` (other rows untouched); query row i of request r sits at position
        ``seq_lens[r] - q_len + i`` and attends causally. Raises ``RuntimeError`` on other
        shapes, dtypes or layouts. Releases the GIL while it runs.
    vectorized() -> bool
        Whether the build has the AVX-512 paths (the callers use the kernel only then).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
EXTENSION_NAME = "moe_dbo_cpu_kernels"
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd")

_lock = threading.Lock()
_state: dict[str, ModuleType | None | float] = {}  # "module", "seconds" (the build or load)


def cpu_kernels_enabled() -> bool:
    """Whether ``MOE_DBO_CPU_KERNELS`` allows the compiled kernels (default: yes)."""
    return os.environ.get("MOE_DBO_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no")


def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, built (or loaded from the cache) on the first call; ``None`` if
    disabled by ``MOE_DBO_CPU_KERNELS=0`` or if the build failed (logged once as a warning)."""
    if not cpu_kernels_enabled():
        return None
    with _lock:
        if "module" not in _state:
            start = time.perf_counter()
            _state["module"] = _build()
            _state["seconds"] = time.perf_counter() - start
            if _state["module"] is not None:
                logger.info("moe-dbo: CPU kernels ready in %.1f s", _state["seconds"])
        return _state["module"]


def prepare_cpu_kernels() -> str:
    """Build or load the kernels now (the engine calls this at start-up, so no step pays for the
    build) and say what runs, for the start-up log: e.g. ``"ready (AVX-512) in 0.2 s"``,
    ``"off (MOE_DBO_CPU_KERNELS=0)"``, ``"not built: plain torch paths"``."""
    if not cpu_kernels_enabled():
        return "off (MOE_DBO_CPU_KERNELS=0): plain torch paths"
    module = cpu_kernels()
    if module is None:
        return "not built: plain torch paths"
    if not module.vectorized():
        return f"built without AVX-512 in {_state['seconds']:.1f} s: plain torch paths"
    return f"ready (AVX-512) in {_state['seconds']:.1f} s"


# torch's build lock (a file another process holds while it compiles) is waited on without a
# timeout; a process killed mid-build leaves it behind, so one older than any build is removed.
STALE_LOCK_SECONDS = 300


def _remove_stale_lock(lock: Path) -> None:
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            logger.warning("moe-dbo: removing a stale CPU-kernel build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def _build() -> ModuleType | None:
    try:
        import torch
        from torch.utils.cpp_extension import get_default_build_root, load

        sources = sorted(CSRC.glob("*.cpp"))
        # the sources' directory too: torch's ninja file names the source paths, so two checkouts
        # sharing one directory would rebuild each time the other one built last
        digest = hashlib.sha256(repr((CFLAGS, torch.__version__, sys.version, str(CSRC))).encode())
        for source in sources:
            digest.update(source.read_bytes())
        build_directory = (
            Path(get_default_build_root()) / f"{EXTENSION_NAME}_{digest.hexdigest()[:16]}"
        )
        build_directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build_directory / "lock")
        module = load(
            name=EXTENSION_NAME,
            sources=[str(p) for p in sources],
            extra_cflags=list(CFLAGS),
            build_directory=str(build_directory),
            verbose=False,
        )
    except Exception as exc:  # no compiler / ninja, or a build error: keep the torch path
        logger.warning(
            "moe-dbo: CPU kernels not built (%s: %s); the plain torch paths run instead",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None
    return module
