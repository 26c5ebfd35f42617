"""Two torchrun nodes on one machine: shared memory within a node, gloo between the nodes.

Two launchers (``--nnodes 2 --node-rank 0/1``, 2 ranks each, one master address and port) run
``launch.generate`` with DP=4 + EP + DBO; torchrun's ``GROUP_RANK`` puts ranks 0-1 and 2-3 on
different nodes although they share the host, so each node's pair exchanges through its own
segment and the pairs through gloo. The greedy tokens equal transformers' (which a one-node run
equals: ``test_generate_e2e``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.cpu_kernels import needs_compiler
from tests.helpers.distributed import REPO, TORCHRUN_ENV, find_free_port
from tests.helpers.generate import DBO_FLAGS, read_outputs


def _launcher(node_rank: int, port: int, *args: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node_rank}",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "launch.generate",
        *args,
    ]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **TORCHRUN_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("backend", ["all_to_all", "deepep_low_latency"])
def test_two_nodes_mix_shared_memory_and_gloo(
    tmp_path, tiny_mixtral_dir, tiny_prompts, tiny_prompts_file, transformers_greedy, backend
):
    out = tmp_path / "out.jsonl"
    port = find_free_port()
    args = (
        f"--model={tiny_mixtral_dir}",
        f"--prompts={tiny_prompts_file}",
        f"--output={out}",
        "--max-tokens=8",
        "--data-parallel-size=4",
        f"--all2all-backend={backend}",
        *DBO_FLAGS,
    )
    launchers = [_launcher(node, port, *args) for node in (0, 1)]
    outputs = []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=300))  # blocking (300 s)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(timeout=10)
    for launcher, (_, stderr) in zip(launchers, outputs, strict=True):
        assert launcher.returncode == 0, stderr[-4000:]
    stdout0, stderr0 = outputs[0]
    assert "collectives over shm+gloo" in stderr0, stderr0[-3000:]
    results = read_outputs(out)
    assert [r["prompt_token_ids"] for r in results] == tiny_prompts
    assert [r["output_token_ids"] for r in results] == transformers_greedy
    assert "microbatched" in stdout0, stdout0
