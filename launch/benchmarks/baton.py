"""Measure the cost of one baton pass between two ubatch threads.

Run ``python -m launch.benchmarks.baton [num_yields]`` (pin to one core with ``taskset -c 0`` to see
the same-core cost). Prints microseconds per pass (one ``dbo_yield`` hands the baton over once).
"""

from __future__ import annotations

import argparse
import threading
import time

from dbo.ubatch_context import dbo_yield, make_ubatch_contexts


def measure_pass_us(num_yields: int, *, timeout_s: float = 30.0) -> float:
    """Two threads each yield ``num_yields`` times; return the mean microseconds per pass."""
    contexts = make_ubatch_contexts(2, timeout_s=timeout_s)

    def run(ctx) -> None:
        with ctx:
            for _ in range(num_yields):
                dbo_yield()

    threads = [threading.Thread(target=run, args=(ctx,)) for ctx in contexts]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return (time.perf_counter() - start) / (2 * num_yields) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="launch.benchmarks.baton", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "num_yields", type=int, nargs="?", default=20_000, help="yields per thread per run"
    )
    num_yields = parser.parse_args(argv).num_yields
    if num_yields < 1:
        parser.error(f"num_yields must be >= 1, got {num_yields}")
    for _ in range(3):
        print(f"baton pass: {measure_pass_us(num_yields):.1f} us ({2 * num_yields} passes)")


if __name__ == "__main__":
    main()
