"""Start-up of graph mode for an engine: pick the backend, point inductor's cache at our directory
(one subdirectory per CPU capability), compile/capture every bucket with a progress bar, and
capture decode-only forwards whole where the backends and the layout allow. The cache and why it
is split by capability: docs/hardware.md#graph-mode-start-up-and-its-cache."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
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


def whole_graph_unavailable_reason(args: EngineArgs, backend, platform) -> str | None:
    """Why decode-only steps cannot be captured whole with ``backend`` (a graph backend class),
    or None when they can (``cudagraph_mode`` FULL_AND_PIECEWISE asked for)."""
    if args.cudagraph_mode != "FULL_AND_PIECEWISE":
        return f"cudagraph_mode {args.cudagraph_mode}"
    if not getattr(backend, "captures_whole", False):
        return f"the {backend.name} graph backend captures pieces only"
    if args.attention_backend not in platform.full_graph_attention_backends:
        allowed = list(platform.full_graph_attention_backends)
        return (
            f"attention backend {args.attention_backend} plans on the host (captured whole "
            f"here: {allowed})"
        )
    if args.enable_expert_parallel:
        return "expert parallelism: the all-to-all and DBO's yields stay between graphs"
    return None


def build_graph_mode(
    model: nn.Module,
    args: EngineArgs,
    *,
    show_progress: bool,
    max_num_blocks_per_req: int,
    device: torch.device,
) -> tuple[nn.Module, CaptureStats | None]:
    """``(GraphModeModel over model, its capture stats)``, or ``(model, None)`` when graph mode is
    off (``--enforce-eager``), the platform has no graph backend, or the backend cannot run here
    (a note on stderr). With FULL_AND_PIECEWISE, decode-only forwards are also captured whole
    (``DecodeGraphs`` over ``max_num_blocks_per_req`` block-table columns on ``device``), or a
    note on stderr says why they run piecewise.

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
    platform = current_platform()
    why_not = whole_graph_unavailable_reason(args, backend, platform)
    if why_not is not None:
        if args.cudagraph_mode == "FULL_AND_PIECEWISE" and show_progress:
            sys.stderr.write(f"moe-dbo: decode-only steps run piecewise: {why_not}\n")
        return graph_model, stats
    from launch.engine.decode_graphs import DecodeGraphs

    whole = DecodeGraphs(
        model,
        capture_sizes,
        capture_whole=backend.capture_whole,
        max_num_blocks_per_req=max_num_blocks_per_req,
        block_size=args.block_size,
        device=device,
        pin_memory=platform.pin_host_memory(device),
    )
    try:
        seconds = whole.capture()
    except RuntimeError as e:  # a host read or sync in the forward: CUDA refuses the capture
        sys.stderr.write(
            f"moe-dbo: decode-only steps run piecewise: capturing them whole failed: {e}\n"
        )
        return graph_model, stats
    graph_model.set_whole_forward(whole)
    stats = dataclasses.replace(
        stats, seconds=stats.seconds + seconds, num_whole_graphs=len(capture_sizes)
    )
    return graph_model, stats
