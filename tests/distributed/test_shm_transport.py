"""The shared-memory transport (``distributed.shm_transport``) against gloo's results, with two
threads issuing at once, a peer that dies mid-exchange, and no segment left in ``/dev/shm``."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from tests.helpers.cpu_kernels import needs_compiler
from tests.helpers.distributed import run_distributed

pytestmark = needs_compiler

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SIZES = (0, 1, 1001, None)  # elements per rank; None: 1 MiB


def _kernels():
    from moe.kernels import cpu_kernels
    from moe.platforms import current_platform

    return cpu_kernels(current_platform().cpu_capability().isa)


def _communicators(timeout_s: float, **kwargs):
    """``(groups, shm communicator, gloo communicator)`` over the EP group of this rank."""
    from distributed import TorchrunEnv, init_distributed
    from distributed.communicator import Communicator
    from distributed.shm_transport import ShmCommunicator, create_communicator

    env = TorchrunEnv.from_environ()
    groups = init_distributed(
        data_parallel_size=env.world_size, enable_expert_parallel=True, timeout_s=timeout_s
    )
    kernels = _kernels()
    assert kernels is not None, "the CPU kernels did not build"
    shm = create_communicator(
        groups.ep_group,
        kernels=kernels,
        node_rank=env.node,
        job_id=env.job_id,
        timeout=groups.timeout,
        **kwargs,
    )
    assert isinstance(shm, ShmCommunicator) and shm.backend == "shm", shm
    return groups, shm, Communicator(groups.ep_group)


def _values(shape, dtype, rank: int, salt: int) -> torch.Tensor:
    """Integers small enough that every sum is exact in bfloat16 (so any order agrees)."""
    n = int(torch.Size(shape).numel())
    values = (torch.arange(n, dtype=torch.int64) * (salt + 3) + rank * 5 + salt) % 29
    return values.to(dtype).reshape(shape)


def _wait(pending) -> None:
    work, after = pending
    if work is not None:
        work.wait()
    if after is not None:
        after()


def _splits(rank: int, world: int, n: int, sending: bool) -> list[int]:
    """Rows rank ``src`` sends rank ``dst``: uneven, a function of both, 0 when n == 0."""

    def rows(src, dst):
        return 0 if n == 0 else n // world + (src * 3 + dst) % 3

    return [rows(rank, p) if sending else rows(p, rank) for p in range(world)]


def _check_op(op: str, dtype, n: int, comms, rank: int, world: int, salt: int) -> None:
    results = []
    for comm in comms:
        if op == "all_to_all_single":
            send, recv = _splits(rank, world, n, True), _splits(rank, world, n, False)
            x = _values((sum(send), 3), dtype, rank, salt)
            out = torch.full((sum(recv), 3), -1, dtype=dtype)
            _wait(comm.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send))
        elif op == "all_gather_into":
            x = _values((n,), dtype, rank, salt)
            out = torch.full((world * n,), -1, dtype=dtype)
            _wait(comm.all_gather_into(out, x))
        elif op == "reduce_scatter_sum":
            x = _values((world * n,), dtype, rank, salt)
            out = torch.full((n,), -1, dtype=dtype)
            _wait(comm.reduce_scatter_sum(out, x))
        else:
            out = _values((n,), dtype, rank, salt)
            _wait(comm.all_reduce_sum(out))
        results.append(out)
    shm, gloo = results
    assert torch.equal(shm, gloo), f"{op} {dtype} n={n}: shm differs from gloo on rank {rank}"


OPS = ("all_to_all_single", "all_gather_into", "reduce_scatter_sum", "all_reduce_sum")


def _collectives_rank(rank: int, world: int, capacities: tuple[int | None, ...]) -> int:
    from distributed.shm_transport import create_communicator

    groups, shm, gloo = _communicators(30.0)
    from distributed import TorchrunEnv

    env = TorchrunEnv.from_environ()
    num_checked = 0
    for capacity in capacities:
        comm = shm
        if capacity is not None:  # a small slot: 1 MiB takes many rounds
            comm = create_communicator(
                groups.ep_group,
                kernels=_kernels(),
                node_rank=env.node,
                job_id=env.job_id,
                timeout=groups.timeout,
                capacity_bytes=capacity,
            )
        for dtype in DTYPES:
            for size in SIZES:
                n = (1 << 20) // dtype.itemsize if size is None else size
                for op in OPS:
                    num_checked += 1
                    _check_op(op, dtype, n, (comm, gloo), rank, world, num_checked)
        comm.close()
    shm.close()
    return num_checked


@pytest.mark.parametrize(
    ("world", "capacities"), [(2, (None, 64 << 10)), (3, (64 << 10,))], ids=["2ranks", "3ranks"]
)
def test_collectives_equal_gloo(world, capacities):
    """Every op, dtype and size (0, 1, odd, 1 MiB) gives gloo's result; a small capacity makes
    1 MiB take many rounds; 3 ranks cut per-destination blocks."""
    counts = run_distributed(_collectives_rank, world, capacities, timeout_s=240)
    assert counts == [len(capacities) * len(DTYPES) * len(SIZES) * len(OPS)] * world


def _two_threads_rank(rank: int, world: int) -> bool:
    _, shm, _ = _communicators(30.0)
    n = 50_000
    issued = threading.Event()
    results = {}

    def ubatch(index: int) -> None:
        # ubatch 0 issues first, ubatch 1 after it (the baton's order), then both wait at once;
        # each waits on the OTHER's handle, as DBO's recv hooks do
        if index == 1:
            issued.wait(10)
        x = _values((world * n,), torch.float32, rank, index)
        out = torch.empty(world * n * world if index == 0 else n)
        pending = shm.all_gather_into(out, x) if index == 0 else shm.reduce_scatter_sum(out, x)
        results[index] = (pending, out)
        if index == 0:
            issued.set()

    threads = [threading.Thread(target=ubatch, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    waits = [threading.Thread(target=_wait, args=(results[i][0],)) for i in (1, 0)]
    for t in waits:
        t.start()
    for t in waits:
        t.join(30)
    gathered, reduced = results[0][1], results[1][1]
    expect = torch.cat([_values((world * n,), torch.float32, r, 0) for r in range(world)])
    assert torch.equal(gathered, expect)
    total = sum(_values((world * n,), torch.float32, r, 1) for r in range(world))
    assert torch.equal(reduced, total[rank * n : (rank + 1) * n])
    shm.close()
    return True


def test_two_threads_issue_at_once():
    assert run_distributed(_two_threads_rank, 2, timeout_s=120) == [True, True]


def _crossed_waits_rank(rank: int, world: int) -> tuple[bool, bool]:
    """Two exchanges on the two channels, waited for in opposite orders on the two ranks: the
    caller runs the one it waits for, the channel's worker the other (after its grace period),
    so neither rank waits forever on the other; and an exchange nobody waits for completes."""
    _, shm, _ = _communicators(20.0)
    first, second = torch.full((8,), float(rank)), torch.full((8,), float(rank + 10))
    works = [shm.all_reduce_sum(first)[0], shm.all_reduce_sum(second)[0]]
    for work in works if rank == 0 else works[::-1]:
        work.wait()
    expect = (sum(range(world)), sum(r + 10 for r in range(world)))
    crossed_ok = (
        first.tolist() == [float(expect[0])] * 8 and second.tolist() == [float(expect[1])] * 8
    )
    unwaited = shm.all_reduce_sum(torch.ones(4))[0]
    deadline = time.monotonic() + 10
    while not unwaited.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)  # the channel's worker runs it: nobody calls wait()
    background_ok = unwaited.is_completed()
    shm.close()
    return crossed_ok, background_ok


def test_waits_in_crossed_orders_and_unwaited_exchanges_complete():
    assert run_distributed(_crossed_waits_rank, 2, timeout_s=120) == [(True, True)] * 2


def _published_at_issue_rank(rank: int, world: int) -> tuple[bool, bool]:
    """On an idle channel an exchange writes and publishes its bytes when issued (a peer that
    waits first finds them there); the ones queued behind it publish when run, and all complete
    with the sums."""
    _, shm, _ = _communicators(20.0)
    tensors = [torch.full((8,), float(rank + 10 * i)) for i in range(3)]
    works = [shm.all_reduce_sum(t)[0] for t in tensors]
    first_published = works[0]._native.published_at_issue()
    for work in works:
        work.wait()
    expect = [float(sum(r + 10 * i for r in range(world))) for i in range(3)]
    sums_ok = [t.tolist() for t in tensors] == [[e] * 8 for e in expect]
    shm.close()
    return first_published, sums_ok


def test_an_exchange_on_an_idle_channel_is_published_at_issue():
    assert run_distributed(_published_at_issue_rank, 2, timeout_s=120) == [(True, True)] * 2


def _dies_rank(rank: int, world: int):
    from distributed import TorchrunEnv

    _, shm, _ = _communicators(20.0)
    job_id = TorchrunEnv.from_environ().job_id
    left = [name for name in os.listdir("/dev/shm") if job_id in name]
    x = torch.ones(4096)
    _wait(shm.all_reduce_sum(x))  # everyone alive: one exchange completes
    if rank == world - 1:
        os.kill(os.getpid(), 9)  # SIGKILL mid-job: no cleanup runs in this process
    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError)) as info:
        _wait(shm.all_reduce_sum(torch.ones(1 << 18)))
    elapsed = time.monotonic() - start
    return left, job_id, str(info.value), elapsed


def test_peer_killed_mid_exchange_fails_every_rank_and_leaves_no_segment():
    """A SIGKILLed rank: both survivors raise naming it, well within the 20 s timeout, and no
    segment of the job is in /dev/shm, neither while it runs (unlinked once every rank had
    mapped it) nor after the kill."""
    world = 3
    survivors = run_distributed(_dies_rank, world, timeout_s=60, num_results=world - 1)
    assert len(survivors) == world - 1
    for left, job_id, message, elapsed in survivors:
        assert left == [], left
        assert f"rank {world - 1}" in message, message
        assert elapsed < 10.0, elapsed
        assert [name for name in os.listdir("/dev/shm") if job_id in name] == []


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_segment(tmp_path, tiny_mixtral_dir, tiny_prompts_file):
    """SIGKILL of torchrun while its ranks run: /dev/shm holds none of the job's segments (they
    were unlinked at start-up, once every rank had mapped them)."""
    import signal
    import subprocess

    from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command

    before = {name for name in os.listdir("/dev/shm") if name.startswith("moe_dbo_")}
    launcher = subprocess.Popen(
        torchrun_command(
            2,
            "launch.generate",
            f"--model={tiny_mixtral_dir}",
            f"--prompts={tiny_prompts_file}",
            f"--output={tmp_path / 'out.jsonl'}",
            "--max-tokens=400",
            "--data-parallel-size=2",
            "--enable-expert-parallel",
        ),
        cwd=REPO,
        env={**os.environ, **TORCHRUN_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the ranks are killed after the check
    )
    try:
        deadline = time.monotonic() + 240
        for line in launcher.stderr:  # blocking reads, bounded by the deadline check
            if "collectives over shm" in line or time.monotonic() > deadline:
                break
        assert "collectives over shm" in line, line
        time.sleep(0.5)  # the ranks are stepping
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        left = {name for name in os.listdir("/dev/shm") if name.startswith("moe_dbo_")} - before
        assert left == set(), left
    finally:
        with contextlib.suppress(ProcessLookupError):  # the orphaned ranks, if any are left
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
