"""Locks on disk: an advisory file lock (the warm-start cache), one run per run directory
(`RunDirLock`), and a writable location checked before anything is built."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from rlkit.refusals import ConfigError


class RunDirInUse(ConfigError):
    """The run directory is held by another live run: a refusal that must touch nothing there."""


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


class RunDirLock:
    """Refuses a run directory that another live run holds (`.rlkit.lock`, an flock that dies with
    its process, so a killed run's directory can be resumed at once). Taken in one system call,
    before the run writes anything else there; a lock file that its holder removed while we waited
    (a refused run undoing its directory) is not taken: the lock is retried on the file now there."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".rlkit.lock"
        self.file = None

    def __enter__(self):
        for _ in range(100):
            f = open(self.path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                holder = self.path.read_text().strip() if self.path.exists() else ""
                raise RunDirInUse(
                    f"hydra.run.dir: {self.path.parent} is in use by a live run ({holder or 'another process'}); "
                    "wait for it, or choose another hydra.run.dir"
                ) from None
            if _same_file(f, self.path):
                break
            f.close()  # its holder removed it after we opened it: lock the one there now
        else:
            raise RunDirInUse(f"hydra.run.dir: {self.path.parent} keeps being removed by another process")
        f.truncate(0)
        f.write(f"pid {os.getpid()}")
        f.flush()
        self.file = f
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


def _same_file(f, path: Path) -> bool:
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
