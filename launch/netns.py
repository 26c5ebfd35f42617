"""Run a torchrun job over a REAL rate-limited link: one Linux network namespace per node.

Builds on this host a bridge namespace and one namespace per node joined by ``tbf``-shaped veth
links, measures the achieved TCP rate, runs ``torchrun`` with the given module in every node's
namespace and deletes the namespaces on exit. Needs root (CAP_NET_ADMIN) and iproute2 (``ip``,
``tc``). Usage and layout: docs/benchmarks.md#links."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

SUBNET = "10.77.0"
PROBE_PORT = 29400
PROBE_SECONDS = 1.0

_PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(30); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n * 8 / (time.perf_counter() - t0) / 1e6)
"""
_PROBE_CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); break
    except OSError: time.sleep(0.05)
buf = b"x" * (1 << 16); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end: c.sendall(buf)
c.close()
"""


def _netns_exec(ns: str) -> list[str]:
    """The prefix that runs a command inside network namespace ``ns``."""
    return ["ip", "netns", "exec", ns]


class Namespaces:
    """The namespaces, veth pairs, bridge and tbf qdiscs of one run; ``close()`` removes them."""

    def __init__(self, *, nnodes: int, rate_mbit: float, burst_bytes: int, queue_ms: float):
        self.prefix = f"mdbo{os.getpid()}"
        self.bridge_ns = f"{self.prefix}-br"
        self.node_ns = [f"{self.prefix}-n{i}" for i in range(nnodes)]
        self.rate_mbit = rate_mbit
        self.burst_bytes = burst_bytes
        self.queue_ms = queue_ms
        self.created: list[str] = []

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _run(self, *cmd: str) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")

    def _ns(self, ns: str, *cmd: str) -> None:
        self._run(*_netns_exec(ns), *cmd)

    def _python(self, node: int, script: str, *args: str) -> list[str]:
        """The command running ``script`` with ``args`` in node ``node``'s namespace."""
        return [*_netns_exec(self.node_ns[node]), sys.executable, "-c", script, *args]

    def _shape(self, ns: str, dev: str) -> None:
        tbf = f"rate {self.rate_mbit}mbit burst {self.burst_bytes} latency {self.queue_ms}ms"
        self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *tbf.split())

    def create(self) -> None:
        for ns in (self.bridge_ns, *self.node_ns):
            self._run("ip", "netns", "add", ns)
            self.created.append(ns)
            self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.bridge_ns, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            port = f"p{i}"
            veth = f"link add eth0 netns {ns} type veth peer name {port} netns {self.bridge_ns}"
            self._run("ip", *veth.split())
            self._ns(self.bridge_ns, "ip", "link", "set", port, "master", "br0")
            self._ns(self.bridge_ns, "ip", "link", "set", port, "up")
            self._ns(ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            self._ns(ns, "ip", "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # what node i sends
            self._shape(self.bridge_ns, port)  # what node i receives

    def close(self) -> None:
        """Delete every namespace this run created (their veths and qdiscs go with them)."""
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()

    def measure_mbit(self, src: int, dst: int, seconds: float = PROBE_SECONDS) -> float:
        """Achieved TCP throughput from node ``src`` to node ``dst`` in Mbit/s."""
        host = self.address(dst)
        server = subprocess.Popen(
            self._python(dst, _PROBE_SERVER, host, str(PROBE_PORT)),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            subprocess.run(
                self._python(src, _PROBE_CLIENT, host, str(PROBE_PORT), str(seconds)),
                check=True,
                timeout=60,
            )
            out, _ = server.communicate(timeout=60)  # blocking wait (timeout 60 s)
            return float(out.strip())
        finally:
            if server.poll() is None:
                server.kill()


def torchrun_commands(ns: Namespaces, nnodes: int, port: int, args: list[str]) -> list[list[str]]:
    """One ``ip netns exec <node ns> torchrun …`` command per node."""
    env = ["env", "GLOO_SOCKET_IFNAME=eth0", "TP_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]
    rendezvous = f"--nproc-per-node=1 --master-addr={ns.address(0)} --master-port={port}".split()
    return [
        [*_netns_exec(node_ns), *env, *torchrun, f"--node-rank={i}", *rendezvous, *args]
        for i, node_ns in enumerate(ns.node_ns)
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.netns",
        usage="%(prog)s [options] -- TORCHRUN_ARGS...",
        description=__doc__.splitlines()[0],
        epilog="Everything after '--' goes to torchrun in each namespace "
        "(e.g. '-- -m launch.bench --data-parallel-size 2 --enable-expert-parallel').",
    )
    parser.add_argument("--nnodes", type=int, default=2, help="nodes = namespaces = ranks")
    parser.add_argument("--rate-mbit", type=float, default=400.0, help="tbf rate per direction")
    parser.add_argument(
        "--burst-bytes",
        type=int,
        default=None,
        help="tbf bucket (default: 1 ms of rate, >= 16 KiB)",
    )
    parser.add_argument("--queue-ms", type=float, default=100.0, help="tbf queueing latency limit")
    parser.add_argument("--master-port", type=int, default=29511)
    return parser


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(namespace options, torchrun arguments); exits 0 on ``--help``, 2 on bad input."""
    parser = _parser()
    split = argv.index("--") if "--" in argv else len(argv)
    ns_args = parser.parse_args(argv[:split])  # --help prints and exits here
    if split == len(argv):
        parser.error("put the torchrun arguments after '--'")
    if ns_args.nnodes < 2 or ns_args.rate_mbit <= 0:
        parser.error(
            f"need --nnodes >= 2 and --rate-mbit > 0, got {ns_args.nnodes}, {ns_args.rate_mbit}"
        )
    return ns_args, argv[split + 1 :]


def _host_error() -> str | None:
    """Why this host cannot build the namespaces (not root, no iproute2), or None."""
    if os.geteuid() != 0:
        return (
            "needs root (CAP_NET_ADMIN) to create network namespaces, veth pairs and tc "
            "qdiscs; run it with sudo"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"iproute2 tools not found: {missing}" if missing else None


def _run_job(net: Namespaces, ns_args: argparse.Namespace, burst: int, job: list[str]) -> int:
    """Create the namespaces, start one torchrun per node, wait for all; their worst status.
    Every process is stopped and the namespaces deleted on the way out (also on a signal)."""
    procs: list[subprocess.Popen] = []
    try:
        net.create()
        achieved = net.measure_mbit(0, 1)
        print(
            f"launch.netns: {ns_args.nnodes} namespaces, tbf {ns_args.rate_mbit:g} Mbit/s per "
            f"direction (burst {burst} B); measured TCP node0->node1: {achieved:.1f} Mbit/s "
            f"({achieved / ns_args.rate_mbit:.0%} of the rate)",
            flush=True,
        )
        commands = torchrun_commands(net, ns_args.nnodes, ns_args.master_port, job)
        procs = [subprocess.Popen(cmd) for cmd in commands]
        status = 0
        for proc in procs:
            status = proc.wait() or status  # blocking wait: the job's own timeouts bound it
        return status
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)  # blocking wait (timeout 10 s) before a kill
            except subprocess.TimeoutExpired:
                proc.kill()
        net.close()


def main(argv: list[str] | None = None) -> int:
    ns_args, job = _parse(sys.argv[1:] if argv is None else argv)
    error = _host_error()
    if error is not None:
        print(f"launch.netns: error: {error}", file=sys.stderr)
        return 2
    if "launch.bench" in job and "--network" not in job:
        job += ["--network", "netns"]
    burst = ns_args.burst_bytes or max(16 * 1024, int(ns_args.rate_mbit * 1e6 / 8 / 1000))
    net = Namespaces(
        nnodes=ns_args.nnodes,
        rate_mbit=ns_args.rate_mbit,
        burst_bytes=burst,
        queue_ms=ns_args.queue_ms,
    )

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds into _run_job's finally

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return _run_job(net, ns_args, burst, job)


if __name__ == "__main__":
    sys.exit(main())
