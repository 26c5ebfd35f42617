"""Every rank notices when its launcher is gone, so that no rank outlives its job: ``LauncherWatch``
polls the parent pid from a daemon thread. Why polling:
docs/serving.md#launcher-watch-polling-the-parent-pid."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

POLL_INTERVAL_S = 0.5
# torchrun sets these in every worker's environment; a plain `python -m` run has none of them
# (its parent is a shell the user may close on purpose, e.g. under nohup).
TORCHRUN_ENV_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def is_under_torchrun(environ=os.environ) -> bool:
    return any(name in environ for name in TORCHRUN_ENV_VARS)


class LauncherWatch:
    """Calls ``on_gone(message)`` once, from a daemon thread, within ``interval_s`` of this
    process's parent (the launcher) exiting. ``start`` does nothing outside torchrun unless
    ``force``; ``stop`` ends the thread."""

    def __init__(self, on_gone: Callable[[str], None], *, interval_s: float = POLL_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.on_gone = on_gone
        self.interval_s = interval_s
        self.parent_pid = os.getppid()
        self._is_watching = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launcher-watch", daemon=True)

    def start(self, *, force: bool = False) -> LauncherWatch:
        if force or is_under_torchrun():
            self._is_watching = True
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def is_launcher_alive(self) -> bool:
        """False once the launcher is gone (always True when not watching)."""
        return not self._is_watching or os.getppid() == self.parent_pid

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # blocking wait, interval_s
            if os.getppid() != self.parent_pid:
                self.on_gone(f"the launcher (pid {self.parent_pid}) is gone")
                return
