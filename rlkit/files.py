"""Writing run files so that a kill or a full disk never leaves a half-written one: each is written
under a temporary name beside its final one and renamed over it (a rename is atomic on POSIX)."""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


class StorageError(OSError):
    """A run file could not be written (disk full, read-only, quota); nothing partial was left."""


def describe(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    return e.strerror or str(e)


@contextmanager
def staged(final: Path, what: str):
    """Yields a temporary path next to `final` (a file or a directory) to write into; on success it
    replaces `final`, on any failure it is removed. An OSError, or a writer's error that hides one
    (torch and safetensors report a full disk as RuntimeError), becomes a StorageError naming `what`."""
    final = Path(final)
    tmp = final.with_name(f".tmp_{final.name}.{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if final.is_dir() and tmp.is_dir():
            _remove(final)
        os.replace(tmp, final)
    except BaseException as e:
        full = isinstance(e, RuntimeError) and _disk_full(final.parent)  # before the partial file is freed
        _remove(tmp)
        if isinstance(e, OSError) or full:
            why = describe(e) if isinstance(e, OSError) else f"no space left on the device ({e})"
            raise StorageError(e.errno if isinstance(e, OSError) else errno.ENOSPC,
                               f"could not write {what} to {final}: {why}") from e
        raise


def write_text(path: Path, text: str) -> None:
    with staged(Path(path), Path(path).name) as tmp:
        tmp.write_text(text)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _disk_full(folder: Path, margin: int = 1 << 20) -> bool:
    """Whether the file system holding `folder` has (almost) no space left."""
    try:
        s = os.statvfs(folder)
    except OSError:
        return False
    return s.f_bavail * s.f_frsize < margin
