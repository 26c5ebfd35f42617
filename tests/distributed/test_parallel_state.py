"""distributed.parallel_state: torchrun environment parsing and the DP / EP process groups."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from distributed import ParallelGroups, TorchrunEnv, destroy_distributed, init_distributed
from tests.helpers.distributed import run_distributed

GOOD_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_from_environ_parses_torchrun_variables():
    env = TorchrunEnv.from_environ(GOOD_ENV)
    assert (env.rank, env.world_size, env.local_rank) == (1, 4, 1)


def test_node_is_torchruns_group_rank_and_job_id_names_the_run():
    env = TorchrunEnv.from_environ({**GOOD_ENV, "LOCAL_WORLD_SIZE": "2"})
    assert (env.node_rank, env.node, env.job_id) == (None, 0, "none-29500")
    env = TorchrunEnv.from_environ(
        {**GOOD_ENV, "GROUP_RANK": "3", "TORCHELASTIC_RUN_ID": "abc", "RANK": "3"}
    )
    assert (env.node_rank, env.node, env.job_id) == (3, 3, "abc-29500")
    with pytest.raises(ValueError, match="GROUP_RANK must be an integer"):
        TorchrunEnv.from_environ({**GOOD_ENV, "GROUP_RANK": "x"})


def test_from_environ_reads_os_environ_at_call_time(monkeypatch):
    for key, value in GOOD_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", "3")
    assert TorchrunEnv.from_environ().rank == 3


@pytest.mark.parametrize(
    "missing", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
)
def test_from_environ_names_missing_variable(missing):
    environ = {k: v for k, v in GOOD_ENV.items() if k != missing}
    with pytest.raises(
        ValueError, match=rf"missing torchrun environment variables \['{missing}'\]"
    ):
        TorchrunEnv.from_environ(environ)


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("RANK", "one", r"RANK must be an integer, got 'one'"),
        ("WORLD_SIZE", "2.5", r"WORLD_SIZE must be an integer"),
        ("RANK", "4", r"RANK must be in \[0, 4\), got 4"),
        ("RANK", "-1", r"RANK must be in \[0, 4\), got -1"),
        ("WORLD_SIZE", "0", r"WORLD_SIZE must be >= 1, got 0"),
        ("LOCAL_RANK", "-2", r"LOCAL_RANK must be >= 0, got -2"),
        ("MASTER_PORT", "70000", r"MASTER_PORT must be in \[1, 65535\], got 70000"),
        ("MASTER_PORT", "http", r"MASTER_PORT must be an integer"),
    ],
)
def test_from_environ_rejects_bad_values(key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        TorchrunEnv.from_environ({**GOOD_ENV, key: value})


def test_init_distributed_rejects_dp_size_other_than_world_size():
    env = TorchrunEnv(rank=0, world_size=2, local_rank=0)
    with pytest.raises(
        ValueError, match=r"data_parallel_size \(3\) must equal the world size \(2\)"
    ):
        init_distributed(data_parallel_size=3, enable_expert_parallel=True, env=env)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"backend": "mpi"}, r"backend must be 'gloo' or 'nccl', got 'mpi'"),
        ({"timeout_s": 0.0}, r"timeout_s must be > 0, got 0.0"),
    ],
)
def test_init_distributed_rejects_bad_arguments(kwargs, pattern):
    env = TorchrunEnv(rank=0, world_size=1, local_rank=0)
    with pytest.raises(ValueError, match=pattern):
        init_distributed(data_parallel_size=1, enable_expert_parallel=False, env=env, **kwargs)
    assert not dist.is_initialized()


def _describe(groups: ParallelGroups) -> dict:
    # Both groups must carry collectives: each rank contributes rank + 1.
    sums = []
    for group in (groups.dp_group, groups.ep_group):
        if group is None:
            sums.append(None)
            continue
        value = torch.tensor([groups.rank + 1.0])
        dist.all_reduce(value, group=group)
        sums.append(value.item())
    return {
        "fields": (groups.rank, groups.world_size, groups.dp_rank, groups.dp_size),
        "ep": (groups.ep_rank, groups.ep_size, groups.ep_group is None),
        "device": str(groups.device),
        "timeout": groups.timeout,
        "sums": sums,
        "separate": groups.dp_group is not groups.ep_group,
    }


def _init_rank(rank: int, world_size: int) -> dict:
    with_ep = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=True, timeout_s=20.0
    )
    result = {"ep": _describe(with_ep)}
    # A second call reuses the default group and builds fresh subgroups.
    without_ep = init_distributed(
        data_parallel_size=world_size, enable_expert_parallel=False, timeout_s=20.0
    )
    result["no_ep"] = _describe(without_ep)
    destroy_distributed()
    result["destroyed"] = not dist.is_initialized()
    destroy_distributed()  # no-op when nothing is left
    return result


def test_init_distributed_two_ranks_with_and_without_expert_parallel():
    results = run_distributed(_init_rank, 2, timeout_s=60)
    for rank, result in enumerate(results):
        ep, no_ep = result["ep"], result["no_ep"]
        assert ep["fields"] == (rank, 2, rank, 2)
        assert ep["ep"] == (rank, 2, False)
        assert ep["sums"] == [3.0, 3.0]
        assert ep["separate"]
        assert ep["device"] == "cpu"
        assert ep["timeout"] == datetime.timedelta(seconds=20)
        assert no_ep["fields"] == (rank, 2, rank, 2)
        assert no_ep["ep"] == (0, 1, True)
        assert no_ep["sums"] == [3.0, None]
        assert result["destroyed"]


def _gloo_worker_threads() -> int:
    """Live threads of this process named by ProcessGroupGloo's workers (``pt_gloo_runloop``)."""
    import contextlib
    from pathlib import Path

    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            names.append(comm.read_text().strip())
    return names.count("pt_gloo_runloop")


def _engine_then_destroy(rank, world_size, model_dir):
    import gc

    from launch.engine.llm_engine import LLMEngine
    from launch.engine.request import Request, SamplingParams
    from tests.helpers.engine import dbo_test_engine_args

    groups = init_distributed(data_parallel_size=world_size, enable_expert_parallel=True)
    args = dbo_test_engine_args(model_dir, world_size, enable_dbo=False)
    # freezes the GC
    engine = LLMEngine(engine_args=args, model=args.resolve_model(), groups=groups)
    engine.add_request(
        Request(request_id=rank, prompt_token_ids=[3, 4, 5], sampling_params=SamplingParams())
    )
    engine.run_until_done()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, rank, group=groups.dp_group)  # as the entry points end
    before = _gloo_worker_threads()
    assert gc.get_freeze_count() > 0
    del engine  # its reference cycles are frozen: only the collection in destroy frees them
    destroy_distributed()
    del groups  # the caller's last reference: the groups end, their destructors join the workers
    return before, _gloo_worker_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc thread names")
def test_destroy_ends_the_gloo_workers_before_interpreter_exit(tiny_mixtral_dir):
    """A gloo worker alive at interpreter finalization can abort the process while it releases a
    finished collective (``terminate called without an active exception``): after
    ``destroy_distributed`` and the caller dropping its groups, none may be left, even with the
    engine's heap frozen by ``freeze_gc_heap``."""
    results = run_distributed(_engine_then_destroy, 2, tiny_mixtral_dir)
    assert all(before > 0 for before, _ in results), results
    assert [after for _, after in results] == [0, 0], results
