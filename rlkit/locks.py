"""The run's files on disk: a writable location checked before anything is built, an advisory file
lock (the warm-start cache), and one run per run directory (`RunDirLock`)."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from rlkit.config import ConfigError


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
    """Refuses a run directory that another live run holds (`.rlkit.lock`), so a killed run's
    directory can be resumed at once."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".rlkit.lock"
        self.lock = file_lock(self.path, wait=False)

    def __enter__(self):
        try:
            f = self.lock.__enter__()
        except BlockingIOError:
            holder = self.path.read_text().strip() or "another process"
            raise ConfigError(
                f"hydra.run.dir: {self.path.parent} is in use by a live run ({holder}); "
                "wait for it, or choose another hydra.run.dir"
            ) from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}")
        f.flush()
        return self

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)
