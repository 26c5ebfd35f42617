"""Graph-mode settings (torch-free): the ``cudagraph_mode``, the padding buckets (CPU's and vLLM's
defaults) and vLLM's ``--compilation-config`` subset. Buckets and modes: docs/hardware.md,
"Buckets and modes"."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from moe.flag_json import parse_json_object

# vLLM's default pattern is [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16): 67 graphs per
# piece. Each inductor graph costs seconds of C++ compilation on a CPU, so the CPU default is
# coarser: powers of two up to 16, then steps of 16 (padding waste <= 16 rows or 50 %).
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128)
# vLLM's largest default CUDA-graph bucket
VLLM_MAX_CAPTURE_SIZE = 512
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")
COMPILATION_CONFIG_KEYS = (
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
)


def cpu_capture_sizes(
    max_capture_size: int | None, *, max_num_batched_tokens: int
) -> tuple[int, ...]:
    """The CPU's default buckets (``DEFAULT_CAPTURE_SIZES``) up to ``max_capture_size`` (default:
    128, capped at ``max_num_batched_tokens``), in steps of 32 above 128."""
    limit = max_capture_size or min(DEFAULT_CAPTURE_SIZES[-1], max_num_batched_tokens)
    sizes = tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= limit)
    if max_capture_size is not None and max_capture_size > DEFAULT_CAPTURE_SIZES[-1]:
        sizes += tuple(range(DEFAULT_CAPTURE_SIZES[-1] + 32, max_capture_size + 1, 32))
    return sizes


def vllm_capture_sizes(
    max_capture_size: int | None, *, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[int, ...]:
    """vLLM's default CUDA-graph buckets: 1, 2, 4, then multiples of 8, up to
    ``max_capture_size`` (default: ``min(512, max_num_seqs, max_num_batched_tokens)``), the limit
    itself included, so that a decode step of ``max_num_seqs`` requests has a graph."""
    limit = max_capture_size or min(VLLM_MAX_CAPTURE_SIZE, max_num_seqs, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


def resolve_capture_sizes(
    sizes: tuple[int, ...] | list[int] | None,
    *,
    max_capture_size: int | None,
    default_sizes: Callable[[int | None], tuple[int, ...]],
) -> tuple[int, ...]:
    """Ascending, deduplicated buckets: ``sizes`` if given, else ``default_sizes(max_capture_size)``
    (the platform's defaults, e.g. ``cpu_capture_sizes`` or ``vllm_capture_sizes``).

    Raises:
        ValueError: a size < 1, an empty list, ``max_capture_size`` < 1, or given sizes above
            ``max_capture_size``.
    """
    if max_capture_size is not None and max_capture_size < 1:
        raise ValueError(f"--max-cudagraph-capture-size must be >= 1, got {max_capture_size}")
    if sizes is not None:
        if not sizes or any(int(s) < 1 for s in sizes):
            raise ValueError(f"--cudagraph-capture-sizes must be integers >= 1, got {list(sizes)}")
        resolved = tuple(sorted({int(s) for s in sizes}))
        if max_capture_size is not None and resolved[-1] > max_capture_size:
            raise ValueError(
                f"--cudagraph-capture-sizes {list(resolved)} exceed "
                f"--max-cudagraph-capture-size {max_capture_size}"
            )
        return resolved
    return default_sizes(max_capture_size)


def check_cudagraph_mode(mode: str, supported: Sequence[str]) -> str:
    """``mode`` if it is one of ``supported`` (a platform's ``graph_modes``).

    Raises:
        ValueError: ``mode`` is no mode of ``CUDAGRAPH_MODES``, or not in ``supported``.
    """
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode {mode!r} is not one of {list(CUDAGRAPH_MODES)}")
    if mode not in supported:
        raise ValueError(
            f"cudagraph_mode {mode} does not run on this platform; choose one of {list(supported)}"
        )
    return mode


def bucket_for(num_rows: int, capture_sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``num_rows``, or None when it exceeds the largest (run eagerly)."""
    index = bisect.bisect_left(capture_sizes, num_rows)
    return capture_sizes[index] if index < len(capture_sizes) else None


def parse_compilation_config(text: str) -> dict:
    """``-cc/--compilation-config`` JSON -> ``{"cudagraph_mode": str | absent,
    "cudagraph_capture_sizes": tuple | absent, "max_cudagraph_capture_size": int | absent}``.

    Raises:
        ValueError: not a JSON object, a key outside ``COMPILATION_CONFIG_KEYS``, or values of the
            wrong type.
    """
    config = parse_json_object("--compilation-config", text, COMPILATION_CONFIG_KEYS)
    out: dict = {}
    mode = config.get("cudagraph_mode")
    if mode is not None:
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {list(CUDAGRAPH_MODES)}, got {mode!r}")
        out["cudagraph_mode"] = mode
    sizes = config.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sizes
        ):
            raise ValueError(f"cudagraph_capture_sizes must be a list of integers, got {sizes!r}")
        out["cudagraph_capture_sizes"] = tuple(sizes)
    max_size = config.get("max_cudagraph_capture_size")
    if max_size is not None:
        if not isinstance(max_size, int) or isinstance(max_size, bool):
            raise ValueError(f"max_cudagraph_capture_size must be an integer, got {max_size!r}")
        out["max_cudagraph_capture_size"] = max_size
    return out
