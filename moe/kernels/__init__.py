"""Our C++ CPU kernels (``csrc/``), compiled on first use for the ISA the platform names:
``cpu_kernels(isa)`` returns the loaded module (``paged_attention``, ``fused_moe``,
``fused_moe_batched``, ``rotary_embedding``, ``pack_sent_rows``, ``unpack_row_ranges``, the
shared-memory transport's ``ShmComm``, ``isa``) or None (the callers keep their plain torch path;
the layers ask ``moe.kernels.host.host_kernels`` of their tensors);
``MOE_DBO_CPU_KERNELS=0`` turns them off. The build, its cache and each kernel's tensors:
docs/hardware.md, "CPU kernels: build and API"."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from moe.platforms.cpu_capability import ISA_LABELS

__all__ = [
    "ISA_FALLBACK",
    "ISA_FLAGS",
    "ISA_LABELS",
    "cpu_kernels",
    "cpu_kernels_enabled",
    "prepare_cpu_kernels",
]

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
EXTENSION_PREFIX = "moe_dbo_cpu_kernels"
CFLAGS = ("-O3", "-fopenmp-simd")
# Per ISA: the -m flags and the defines under which ATen's vec headers select their AVX2 or
# AVX-512 Vectorized (and name their inline namespace), as torch's own build passes them for its
# per-ISA kernel copies (cmake/Codegen.cmake). -mf16c: the AVX2 headers' fp16 conversions need it.
# The split-unaligned flags stop GCC's generic tuning from splitting 256-bit unaligned loads.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": (
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mno-avx256-split-unaligned-load",
        "-mno-avx256-split-unaligned-store",
        "-DCPU_CAPABILITY=AVX2",
        "-DCPU_CAPABILITY_AVX2",
    ),
    "avx512": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ),
}
ISA_FLAGS["avx512_bf16"] = (*ISA_FLAGS["avx512"], "-mavx512bf16", "-DMOE_DBO_AVX512_BF16")
# what is built where an ISA's build fails (an older compiler without its -m flag)
ISA_FALLBACK = {"avx512_bf16": "avx512"}

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}  # isa -> the build (None: it failed)
_seconds: dict[str, float] = {}  # isa -> time of its build or load


def cpu_kernels_enabled() -> bool:
    """Whether ``MOE_DBO_CPU_KERNELS`` allows the compiled kernels (default: yes)."""
    return os.environ.get("MOE_DBO_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no")


def _check_isa(isa: str | None) -> str | None:
    isa = None if isa == "default" else isa
    if isa is not None and isa not in ISA_FLAGS:
        raise ValueError(f"isa={isa!r}: expected one of {sorted(ISA_FLAGS)}, 'default' or None")
    return isa


def cpu_kernels(isa: str | None) -> ModuleType | None:
    """The kernel module compiled for ``isa``, built (or loaded from the cache) on the first call.

    Args:
        isa: a key of ``ISA_FLAGS``, or ``None`` / ``"default"`` (nothing to build). The caller
            makes sure this CPU runs it (``current_platform().cpu_capability().isa``).

    Returns:
        The module (its ``isa()`` names the build: ``ISA_FALLBACK``'s where ``isa``'s failed), or
        ``None`` if ``isa`` is None, if disabled by ``MOE_DBO_CPU_KERNELS=0`` or if the build
        failed (logged once as a warning).

    Raises:
        ValueError: on another ``isa``.
    """
    isa = _check_isa(isa)
    if isa is None or not cpu_kernels_enabled():
        return None
    with _lock:
        return _load(isa)


def _load(isa: str) -> ModuleType | None:
    """``cpu_kernels`` under ``_lock``: build once, else the fallback's build."""
    if isa not in _modules:
        start = time.perf_counter()
        module = _build(isa)
        if module is None and isa in ISA_FALLBACK:
            module = _load(ISA_FALLBACK[isa])
        _modules[isa], _seconds[isa] = module, time.perf_counter() - start
        if module is not None:
            logger.info("moe-dbo: CPU kernels (%s) ready in %.1f s", module.isa(), _seconds[isa])
    return _modules[isa]


def prepare_cpu_kernels(isa: str | None) -> str:
    """Build or load the kernels for ``isa`` now (the engine calls this at start-up, so no step pays
    for the build) and say what runs, for the start-up log: e.g. ``"ready (AVX2) in <seconds> s"``,
    ``"off (MOE_DBO_CPU_KERNELS=0): plain torch paths"``,
    ``"not built (no AVX2 or AVX-512 to build for): plain torch paths"`` (no time spent).

    Raises:
        ValueError: on an ``isa`` other than a key of ``ISA_FLAGS``, ``"default"`` or None.
    """
    isa = _check_isa(isa)
    if not cpu_kernels_enabled():
        return "off (MOE_DBO_CPU_KERNELS=0): plain torch paths"
    if isa is None:
        return "not built (no AVX2 or AVX-512 to build for): plain torch paths"
    module = cpu_kernels(isa)
    if module is None:
        why = _failures.get(isa, f"{ISA_LABELS[isa]} build failed")
        return f"not built ({why}): plain torch paths"
    return f"ready ({ISA_LABELS[module.isa()]}) in {_seconds[isa]:.1f} s"


# Build locks. torch's own (``<build directory>/lock``, ``torch.utils.file_baton.FileBaton``) is
# waited on without a timeout and names no owner, so a build killed mid-way would leave every later
# start waiting forever. Every build here first takes ours (``BUILD_LOCK`` beside it, holding
# "<pid> <host>"): a waiter sees who holds it, takes it over from a dead owner at once (from an
# owner it cannot check, another host's, once the lock is ``STALE_LOCK_SECONDS`` old) and gives up
# after ``BUILD_LOCK_TIMEOUT_S`` (the plain torch paths run, and the line says why). Whoever holds
# ours holds the only live build of that directory, so a torch lock found then is a dead build's.
BUILD_LOCK = "moe_dbo_build.lock"
STALE_LOCK_SECONDS = 300
BUILD_LOCK_TIMEOUT_S = 300.0  # the longest a start waits for another process's build
LOCK_REPORT_EVERY_S = 10.0  # a waiting line at once, then this often
_LOCK_POLL_S = 0.1
_failures: dict[str, str] = {}  # isa -> why its build did not happen (for the start-up line)


@dataclass(frozen=True, slots=True, kw_only=True)
class LockHolder:
    """Who holds a build lock: ``is_alive`` None where it cannot be checked (another host's pid,
    or a lock without an owner written in it); ``age_s`` since the lock was written."""

    description: str  # e.g. "pid 123 (alive)"
    is_alive: bool | None
    age_s: float

    @property
    def is_stale(self) -> bool:
        """A dead owner's, or one that cannot be checked and is ``STALE_LOCK_SECONDS`` old."""
        if self.is_alive is None:
            return self.age_s > STALE_LOCK_SECONDS
        return not self.is_alive


def _lock_holder(lock: Path) -> LockHolder | None:
    """The holder of ``lock`` (its "<pid> <host>"), or None when there is no lock."""
    try:
        age_s = time.time() - lock.stat().st_mtime
        pid_text, _, host = lock.read_text().strip().partition(" ")
    except FileNotFoundError:
        return None
    if not pid_text.isdigit():  # just created, its owner not written yet, or not ours
        return LockHolder(description="an unknown process", is_alive=None, age_s=age_s)
    if host != socket.gethostname():
        where = host or "an unknown host"
        return LockHolder(description=f"pid {pid_text} on {where}", is_alive=None, age_s=age_s)
    is_alive = _is_running(int(pid_text))
    state = "alive" if is_alive else "dead"
    return LockHolder(description=f"pid {pid_text} ({state})", is_alive=is_alive, age_s=age_s)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:  # a zombie (dead, not yet reaped) holds nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _acquire_build_lock(directory: Path, timeout_s: float) -> str | None:
    """Take ``directory/BUILD_LOCK`` (written "<pid> <host>"), waiting at most ``timeout_s`` for a
    live holder, and removing a dead or stale one. A line every ``LOCK_REPORT_EVERY_S`` while it
    waits. Returns None once held, else why it gave up (for the start-up line)."""
    lock = directory / BUILD_LOCK
    start = time.monotonic()
    next_report = start
    while True:  # bounded by timeout_s
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {socket.gethostname()}\n")
            return None
        holder = _lock_holder(lock)
        if holder is None:
            continue  # released meanwhile: try again
        who, age = holder.description, holder.age_s
        if holder.is_stale:
            logger.warning(
                "moe-dbo: removing the CPU kernel build lock %s of %s (%.0f s old)", lock, who, age
            )
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            continue
        waited = time.monotonic() - start
        if waited >= timeout_s:
            return f"gave up after {waited:.0f} s waiting for the build lock {lock} held by {who}"
        if time.monotonic() >= next_report:
            logger.warning(
                "moe-dbo: waiting for the CPU kernel build lock %s held by %s for %.0f s",
                lock,
                who,
                age,
            )
            next_report += LOCK_REPORT_EVERY_S
        time.sleep(_LOCK_POLL_S)


def _release_build_lock(directory: Path) -> None:
    """Remove ``directory/BUILD_LOCK`` if this process holds it."""
    lock = directory / BUILD_LOCK
    with contextlib.suppress(FileNotFoundError):
        if lock.read_text().split(" ")[0] == str(os.getpid()):
            lock.unlink()


def _remove_dead_torch_lock(directory: Path) -> None:
    """Under our lock: torch's lock there was left by a build that died holding it."""
    lock = directory / "lock"
    if lock.exists():
        logger.warning("moe-dbo: removing torch's build lock %s, left by a killed build", lock)
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def build_root() -> Path:
    """Where the builds go: ``TORCH_EXTENSIONS_DIR`` if set, else torch's per-user default (as
    ``torch.utils.cpp_extension.load`` decides it; its ``get_default_build_root`` alone ignores
    the variable)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_directory(isa: str) -> Path:
    """Where ``isa``'s build goes: ``build_root()`` / ``<extension name>_<hash>``, the hash over the
    sources and headers, their directory, the flags and torch's and Python's versions.

    Raises:
        ValueError: ``isa`` not a key of ``ISA_FLAGS``.
    """
    import torch

    if isa not in ISA_FLAGS:
        raise ValueError(f"isa={isa!r}: expected one of {sorted(ISA_FLAGS)}")
    flags = [*CFLAGS, *ISA_FLAGS[isa]]
    # the sources' directory too: torch's ninja file names the source paths, so two checkouts
    # sharing one directory would rebuild each time the other one built last
    digest = hashlib.sha256(repr((flags, torch.__version__, sys.version, str(CSRC))).encode())
    for source in [*sorted(CSRC.glob("*.cpp")), *sorted(CSRC.glob("*.h"))]:  # no dependency scan
        digest.update(source.read_bytes())
    return build_root() / f"{EXTENSION_PREFIX}_{isa}_{digest.hexdigest()[:16]}"


def _build(isa: str) -> ModuleType | None:
    name = f"{EXTENSION_PREFIX}_{isa}"
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory(isa)
        directory.mkdir(parents=True, exist_ok=True)
        gave_up = _acquire_build_lock(directory, BUILD_LOCK_TIMEOUT_S)
        if gave_up is not None:  # a start must not hang on another process's build
            _failures[isa] = gave_up
            logger.warning(
                "moe-dbo: CPU kernels (%s) not built (%s); the plain torch paths run instead",
                isa,
                gave_up,
            )
            return None
        try:
            _remove_dead_torch_lock(directory)
            module = load(
                name=name,
                sources=[str(p) for p in sorted(CSRC.glob("*.cpp"))],
                extra_cflags=[*CFLAGS, *ISA_FLAGS[isa]],
                build_directory=str(directory),
                verbose=False,
            )
        finally:
            _release_build_lock(directory)
    except Exception as exc:  # no compiler / ninja, or a build error: keep the torch path
        logger.warning(
            "moe-dbo: CPU kernels (%s) not built (%s: %s); the plain torch paths run instead",
            isa,
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None
    return module
