"""Issue 28 cases 4 and 3 end to end on loopback (2 DP ranks, one launch, bounded in time):

- a frozen rank (SIGSTOP) blocks the lockstep exchange: ``/health`` answers 503 with the reason
  within ``--engine-stall-timeout`` (plus slack), and 200 again once the rank runs;
- the launcher SIGKILLed (the OOM killer's way): every rank notices, prints one line, and is gone
  within 30 s, the HTTP port released.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.serve import get, start_server

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 2


def _is_running(pid: int) -> bool:
    """False once ``pid`` exited (gone, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_health(base_url: str, want_ok: bool, timeout_s: float) -> tuple[int, bytes, float]:
    start = time.monotonic()
    while True:
        status, body = get(base_url, "/health", timeout=10)
        if (status == 200) == want_ok:
            return status, body, time.monotonic() - start
        assert time.monotonic() - start < timeout_s, (status, body)
        time.sleep(0.1)


def test_health_fails_while_a_rank_is_frozen_and_ranks_end_with_their_launcher(
    tmp_path, tiny_mixtral_dir
):
    server = start_server(
        2,
        f"--model={tiny_mixtral_dir}",
        "--dtype=float32",
        "--max-model-len=64",
        "--block-size=4",
        f"--engine-stall-timeout={STALL_TIMEOUT_S}",
        "--distributed-timeout=60",
        log_path=tmp_path / "log",
    )
    port = int(server.base_url.rsplit(":", 1)[1])
    ranks = sorted(
        map(
            int,
            subprocess.run(
                ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True, check=True
            ).stdout.split(),
        )
    )
    try:
        assert len(ranks) == 2 and _wait_health(server.base_url, True, 10)[0] == 200
        os.kill(ranks[1], signal.SIGSTOP)
        try:
            status, body, after = _wait_health(server.base_url, False, STALL_TIMEOUT_S + 15)
        finally:
            os.kill(ranks[1], signal.SIGCONT)
        print(f"/health {status} {after:.1f} s after SIGSTOP")
        assert status == 503 and "has not completed a step" in json.loads(body)["error"]["message"]
        _wait_health(server.base_url, True, 15)  # the rank runs again: healthy again

        server.proc.kill()  # the launcher, as the OOM killer ends it
        server.proc.wait(timeout=10)
        killed_at = time.monotonic()
        while any(map(_is_running, ranks)):
            assert time.monotonic() - killed_at < 30, "ranks outlived their launcher"
            time.sleep(0.2)
        print(f"every rank gone {time.monotonic() - killed_at:.1f} s after the launcher")
    finally:
        for pid in ranks:  # never leave a rank behind, whatever failed above
            if _is_running(pid):
                os.kill(pid, signal.SIGKILL)
    log = server.log()
    lines = re.findall(
        r"launch\.serve \[rank (\d)\]: error: the launcher \(pid \d+\) is gone.*", log
    )
    assert sorted(lines) == ["0", "1"], log[-3000:]
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # the port is released


def test_launcher_watch_reports_a_changed_parent_once():
    """The watch in process: a fake parent pid stands for a launcher that is gone."""
    import threading

    from launch.serving.launcher_watch import LauncherWatch

    messages: list[str] = []
    done = threading.Event()
    watch = LauncherWatch(lambda m: (messages.append(m), done.set()), interval_s=0.05)
    assert watch.is_launcher_alive()  # not watching yet
    watch.parent_pid = -1  # as if the launcher died and this process was reparented
    watch.start(force=True)
    assert done.wait(5) and messages == ["the launcher (pid -1) is gone"]
    assert not watch.is_launcher_alive()
    watch.stop()
