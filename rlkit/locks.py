"""Locks on disk: an advisory file lock (the warm-start cache), and a writable location checked
before anything is built. The run directory's own lock is `rlkit.rundir.RunDirLock`."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from rlkit.refusals import ConfigError


def check_writable(path: str | Path, key: str) -> None:
    """Create `path` and write a probe file there, or fail naming the key."""
    path = Path(os.path.expanduser(str(path)))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".rlkit_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}: directory {path} is not writable ({e.strerror or e})") from e


@contextmanager
def file_lock(path: Path, wait: bool = True):
    """An exclusive flock on the file `path` for the block; it dies with its process, however the
    process ends. `wait=False`: raise BlockingIOError at once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
