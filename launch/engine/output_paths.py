"""Output paths checked writable before any work starts (``--output``, ``--timeline-dir``, the
profiler's trace directory).

Entry points call ``check_output_paths`` on every rank before the process group exists, so a path
that cannot be written ends every rank within seconds with one line naming the flag and the path,
instead of failing after the whole generation (or at server shutdown) with nothing written.
The check writes and removes a probe file: permission bits say nothing about read-only mounts,
pseudo file systems (``/proc``) or root, so only an actual write tells.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _probe_dir(directory: Path, flag: str, path: str) -> None:
    """Create ``directory`` (and parents) and write + remove a probe file in it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise OSError(
            f"{flag} {path!r} is not writable: {reason} ({e.filename or directory})"
        ) from None


def check_output_file(path: str, flag: str) -> None:
    """Raise OSError (one line naming ``flag`` and ``path``) unless ``path`` can be written as a
    file: its directory exists or can be created and takes a new file, and ``path`` is not a
    directory nor an existing file this process cannot open for writing. Leaves no file behind
    (the directory may have been created)."""
    target = Path(path)
    if target.is_dir():
        raise OSError(f"{flag} {path!r} is a directory; give a file path")
    _probe_dir(target.parent, flag, path)
    if target.exists():
        try:
            with open(target, "a", encoding="utf-8"):  # append mode: nothing is truncated
                pass
        except OSError as e:
            raise OSError(f"{flag} {path!r} is not writable: {e.strerror or e}") from None


def check_output_dir(path: str, flag: str) -> None:
    """Raise OSError (one line naming ``flag`` and ``path``) unless ``path`` is, or can be created
    as, a directory that takes new files."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OSError(f"{flag} {path!r} exists and is not a directory")
    _probe_dir(target, flag, path)


def check_output_paths(args, files: dict[str, str | None] | None = None) -> None:
    """``check_output_file`` of each given path in ``files`` (flag -> path, e.g. ``{"--output":
    ns.output}``), and ``check_output_dir`` of the directories ``args`` (``EngineArgs``) writes
    to: ``--timeline-dir`` and the profiler's ``torch_profiler_dir`` (``--profiler-config``)."""
    for flag, path in (files or {}).items():
        if path:
            check_output_file(path, flag)
    if args.timeline_dir:
        check_output_dir(args.timeline_dir, "--timeline-dir")
    profiler_dir = args.profiler().torch_profiler_dir
    if profiler_dir:
        check_output_dir(profiler_dir, "--profiler-config torch_profiler_dir")
