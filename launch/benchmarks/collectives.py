"""Benchmark: the latency of the collectives a DP+EP step issues, on the ranks' own backend.

Per step the engine issues the DP vote (``all_reduce``) and, per MoE layer, a dispatch and a
combine (``distributed.collectives``: ``all_to_all_single``, ``all_gather_into``,
``reduce_scatter_sum``). On one host, a collective's fixed cost sets how small a model can be
before 2 ranks lose to 1; this prints it, per op and payload size. Rank 0 prints microseconds per
call (median of ``--rounds`` rounds of ``--calls`` back-to-back calls, each waited for before the
next is issued), and the round trip of a plain TCP loopback socket between two threads of this
process for scale.

    torchrun --standalone --nproc-per-node 2 -m launch.benchmarks.collectives \\
        [--sizes 64 10240 1048576] [--calls 200] [--rounds 5]

Sizes are payload bytes per rank (float32 rows). Errors: ``ValueError`` for a size that is not a
positive multiple of 4 bytes or fewer than 2 ranks.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distributed import collectives

DEFAULT_SIZES = (64, 10_240, 1_048_576)


def _wait(pending: collectives.Pending) -> None:
    work, after = pending
    if work is not None:
        work.wait()
    if after is not None:
        after()


def ops(num_bytes: int, world: int) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """One call of each collective on ``num_bytes`` of float32 per rank over the default group,
    and a check that raises ``AssertionError`` unless every output holds what its op defines
    (ones sent and gathered, zeros reduced: repeated calls leave them so).

    Raises:
        ValueError: ``num_bytes`` not a positive multiple of 4.
    """
    if num_bytes <= 0 or num_bytes % 4:
        raise ValueError(f"--sizes takes positive multiples of 4 bytes, got {num_bytes}")
    rows = -(-(num_bytes // 4) // world) * world  # all_to_all and reduce_scatter split evenly
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    received, gathered = torch.empty(rows), torch.empty(world * rows)
    reduced, scattered = torch.zeros(rows), torch.empty(rows // world)
    group, even = dist.group.WORLD, [rows // world] * world
    calls = {
        "all_reduce": lambda: dist.all_reduce(reduced, group=group),
        "all_to_all_single": lambda: _wait(
            collectives.all_to_all_single(
                received, ones, output_split_sizes=even, input_split_sizes=even, group=group
            )
        ),
        "all_gather_into": lambda: _wait(collectives.all_gather_into(gathered, ones, group=group)),
        # the fallback reduces its input in place: zeros stay zeros
        "reduce_scatter_sum": lambda: _wait(
            collectives.reduce_scatter_sum(scattered, zeros, group=group)
        ),
    }

    def check() -> None:
        for name, out, value in (
            ("all_reduce", reduced, 0.0),
            ("all_to_all_single", received, 1.0),
            ("all_gather_into", gathered, 1.0),
            ("reduce_scatter_sum", scattered, 0.0),
        ):
            assert bool((out == value).all()), f"{name} on {num_bytes} bytes gave a wrong result"

    return calls, check


def median_us(fn: Callable[[], None], *, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean microseconds per call of ``calls`` calls of ``fn``."""
    for _ in range(max(1, calls // 10)):  # warm-up: connections, buffers
        fn()
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_round)


def tcp_round_trip_us(calls: int) -> float:
    """Microseconds per 8-byte ping-pong over a loopback TCP socket between two threads."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(calls):
                conn.sendall(conn.recv(8))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(calls):
            client.sendall(b"8 bytes!")
            client.recv(8)
        elapsed = time.perf_counter() - start
    thread.join(timeout=30)
    server.close()
    return elapsed / calls * 1e6


def measure(sizes: list[int], *, calls: int, rounds: int) -> list[tuple[str, int, float]]:
    """``(op, bytes, µs per call)`` for each op and size, on every rank (collectively), each
    size's results checked after its calls.

    Raises:
        ValueError: fewer than 2 ranks, or a bad size (``ops``).
    """
    world = dist.get_world_size()
    if world < 2:
        raise ValueError("launch.benchmarks.collectives needs 2 or more ranks (torchrun)")
    rows = []
    for num_bytes in sizes:
        calls_of, check = ops(num_bytes, world)
        for name, fn in calls_of.items():
            rows.append((name, num_bytes, median_us(fn, calls=calls, rounds=rounds)))
        check()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.collectives", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    ns = parser.parse_args(argv)
    for num_bytes in ns.sizes:
        if num_bytes <= 0 or num_bytes % 4:
            parser.error(f"--sizes takes positive multiples of 4 bytes, got {num_bytes}")
    dist.init_process_group("gloo")
    try:
        rows = measure(ns.sizes, calls=ns.calls, rounds=ns.rounds)
        if dist.get_rank() == 0:
            print(f"backend {dist.get_backend()}, {dist.get_world_size()} ranks")
            print("| op | bytes per rank | µs per call |\n| --- | --- | --- |")
            for name, num_bytes, us in rows:
                print(f"| {name} | {num_bytes:,} | {us:,.1f} |")
            print(f"TCP loopback round trip (8 bytes): {tcp_round_trip_us(ns.calls):.1f} µs")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
