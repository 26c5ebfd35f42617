"""Benchmark: the latency of the collectives a DP+EP step issues, on the engine's own groups.

gloo and the platform's transport side by side, with a TCP loopback round trip for scale (2 ranks
or more under torchrun). What it measures:
docs/benchmarks.md#collectives-benchmark-what-it-measures."""

from __future__ import annotations

import argparse
import datetime
import functools
import socket
import statistics
import threading
import time
from collections.abc import Callable

import torch

from distributed import collectives
from distributed.all2all.base import complete_exchange
from distributed.communicator import Communicator
from distributed.parallel_state import TorchrunEnv, destroy_distributed, init_distributed
from moe.platforms import current_platform

DEFAULT_SIZES = (64, 10_240, 1_048_576)
TIMEOUT_S = 60.0  # of every wait, as the engine's --distributed-timeout


def check_size(num_bytes: int) -> None:
    """Raises ``ValueError`` unless ``num_bytes`` is a positive multiple of 4 (float32 rows)."""
    if num_bytes <= 0 or num_bytes % 4:
        raise ValueError(f"--sizes takes positive multiples of 4 bytes, got {num_bytes}")


def _waited(
    op: str,
    issue: Callable[[], collectives.Pending],
    *,
    rank: int,
    timeout: datetime.timedelta,
    num_bytes: int,
) -> Callable[[], None]:
    """A call that issues one collective and waits for it as the engine waits
    (``complete_exchange``: ``timeout``, then TimeoutError naming ``op`` and ``rank``)."""

    def call() -> None:
        start_ns = time.perf_counter_ns()
        complete_exchange(
            issue(),
            op=op,
            rank=rank,
            timeout=timeout,
            num_bytes=num_bytes,
            start_ns=start_ns,
            link=None,
        )

    return call


def ops(
    num_bytes: int, group: Communicator, timeout: datetime.timedelta
) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """One call of each collective on ``num_bytes`` of float32 per rank over ``group``, each
    waited for as the engine waits (``_waited``), and a check that raises ``AssertionError``
    unless every output holds what its op defines (ones sent and gathered, zeros reduced:
    repeated calls leave them so).

    Raises:
        ValueError: ``num_bytes`` not a positive multiple of 4.
    """
    check_size(num_bytes)
    world, rank = group.size, group.rank
    rows = -(-(num_bytes // 4) // world) * world  # all_to_all and reduce_scatter split evenly
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    received, gathered = torch.empty(rows), torch.empty(world * rows)
    reduced, scattered = torch.zeros(rows), torch.empty(rows // world)
    even = [rows // world] * world
    # op -> (issue one call, its output, the value every element of it must hold)
    table = {
        "all_reduce": (
            lambda: collectives.all_reduce_sum(reduced, group=group),
            reduced,
            0.0,
        ),
        "all_to_all_single": (
            lambda: collectives.all_to_all_single(
                received, ones, output_split_sizes=even, input_split_sizes=even, group=group
            ),
            received,
            1.0,
        ),
        "all_gather_into": (
            lambda: collectives.all_gather_into(gathered, ones, group=group),
            gathered,
            1.0,
        ),
        # the fallback reduces its input in place: zeros stay zeros
        "reduce_scatter_sum": (
            lambda: collectives.reduce_scatter_sum(scattered, zeros, group=group),
            scattered,
            0.0,
        ),
    }
    calls = {
        op: _waited(op, issue, rank=rank, timeout=timeout, num_bytes=num_bytes)
        for op, (issue, _, _) in table.items()
    }

    def check() -> None:
        for op, (_, out, value) in table.items():
            assert bool((out == value).all()), f"{op} on {num_bytes} bytes gave a wrong result"

    return calls, check


def median_us(fn: Callable[[], None], *, calls: int, rounds: int) -> float:
    """Median over the ``rounds * calls`` calls of ``fn`` (each timed on its own), in µs."""
    times = []
    for _ in range(rounds):
        fn()  # warm-up of the round (not timed)
        for _ in range(calls):
            start = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


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


def measure(
    sizes: list[int],
    comms: dict[str, Communicator],
    timeout: datetime.timedelta,
    *,
    calls: int,
    rounds: int,
) -> dict[tuple[str, int], dict[str, float]]:
    """``(op, bytes) -> {transport: µs per call}`` for each op and size over each of ``comms``
    (transport name -> communicator of one group; collective: every rank calls it), each size's
    results checked after its calls.

    Raises:
        ValueError: a bad size (``check_size``).
    """
    table: dict[tuple[str, int], dict[str, float]] = {}
    for num_bytes in sizes:
        for transport, comm in comms.items():
            calls_of, check = ops(num_bytes, comm, timeout)
            for name, fn in calls_of.items():
                us = median_us(fn, calls=calls, rounds=rounds)
                table.setdefault((name, num_bytes), {})[transport] = us
            check()
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.collectives", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    ns = parser.parse_args(argv)
    try:
        for num_bytes in ns.sizes:
            check_size(num_bytes)
        env = TorchrunEnv.from_environ()
    except ValueError as e:
        parser.error(str(e))
    if env.world_size < 2:
        parser.error("needs 2 or more ranks: run it under torchrun --nproc-per-node 2")
    # the engine's groups: the EP group is the one dispatch and combine run on
    groups = init_distributed(
        data_parallel_size=env.world_size,
        enable_expert_parallel=True,
        timeout_s=TIMEOUT_S,
        env=env,
        make_communicator=functools.partial(
            current_platform().make_communicator,
            env=env,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        ),
    )
    comms = {"gloo": Communicator(groups.ep_group)}
    comms.setdefault(groups.ep_comm.backend, groups.ep_comm)  # the platform's transport
    try:
        table = measure(ns.sizes, comms, groups.timeout, calls=ns.calls, rounds=ns.rounds)
        if groups.rank == 0:
            print(f"transports {', '.join(comms)}; {groups.world_size} ranks")
            print(_format_table(table, list(comms)))
            print(f"TCP loopback round trip (8 bytes): {tcp_round_trip_us(ns.calls):.1f} µs")
    finally:
        for comm in comms.values():
            comm.close()
        del groups, comms
        destroy_distributed()


def _format_table(table: dict[tuple[str, int], dict[str, float]], transports: list[str]) -> str:
    """A markdown table: op, bytes, µs per call for each transport, and gloo's over the last's."""
    ratio = len(transports) > 1
    head = ["op", "bytes per rank", *(f"{t} µs" for t in transports)]
    head += [f"gloo / {transports[-1]}"] if ratio else []
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (name, num_bytes), times in table.items():
        cells = [name, f"{num_bytes:,}", *(f"{times[t]:,.1f}" for t in transports)]
        cells += [f"{times['gloo'] / times[transports[-1]]:.1f}x"] if ratio else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
