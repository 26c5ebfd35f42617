"""Run a function on N local gloo ranks, as torchrun would, and collect each rank's result.

Every rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and calls ``fn(rank, world_size, *args)``; the function initialises the process
group itself (usually through ``distributed.init_distributed``). A rank that raises, dies or
outlives ``timeout_s`` fails the whole run with that rank's traceback; the other ranks are killed,
so a broken collective never hangs the test suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun_command(nproc: int, module: str, *args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node nproc -m module args…``, run by this interpreter."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def platform_communicators(timeout_s: float):
    """``init_distributed``'s ``make_communicator`` as the engine passes it: the platform's
    transport (on the CPU, shared memory between the ranks of this node). Call in a rank."""
    import datetime
    import functools

    from distributed import TorchrunEnv
    from moe.platforms import current_platform

    return functools.partial(
        current_platform().make_communicator,
        env=TorchrunEnv.from_environ(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def expected_transport() -> str:
    """What the CPU platform's groups of one host run on: ``"shm"`` where a C++ compiler builds
    the kernels, else ``"gloo"``."""
    import shutil

    return "shm" if shutil.which("c++") or shutil.which("g++") else "gloo"


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, env, results) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    num_results: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). ``num_results``: return once
    that many ranks have reported (ranks that may die), their results in rank order; None: all.
    Raises ``RuntimeError`` naming the first rank that failed (with its traceback), or
    ``TimeoutError`` if the ranks do not report within ``timeout_s`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, dict(env or {}), results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        while len(collected) < (world_size if num_results is None else num_results):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout_s:.0f} s"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [collected[rank] for rank in sorted(collected)]
