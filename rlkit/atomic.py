"""Files on disk. Run files are written so that a kill or a full disk never leaves a half-written
one: each is written under a temporary name beside its final one and renamed over it (a rename is
atomic on POSIX); folders carry manifests of checksums. Also an advisory file lock (the warm-start
cache) and a writable location checked before anything is built. The run directory's own lock is
`rlkit.rundir.RunDirLock`."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from rlkit.refusals import ConfigError


class StorageError(OSError):
    """A run file could not be written (disk full, read-only, quota); nothing partial was left."""


def describe(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    return e.strerror or str(e)


def storage_failed(e: OSError) -> bool:
    """Whether `e` is a run file that could not be written: a `StorageError` from `staged`, or an
    append (metrics, samples) that found the disk full."""
    return isinstance(e, StorageError) or e.errno in (errno.ENOSPC, errno.EDQUOT)


def describe_write(e: OSError) -> str:
    return e.strerror if isinstance(e, StorageError) else f"could not write {e.filename or 'a run file'}: {describe(e)}"


@contextmanager
def staged(final: Path, what: str):
    """Yields a temporary path next to `final` (a file or a directory) to write into; on success it
    replaces `final`, on any failure it is removed. An OSError, or a writer's error that hides one
    (torch reports a full disk as RuntimeError, safetensors as its own SafetensorError), becomes a
    StorageError naming `what`."""
    final = Path(final)
    tmp = final.with_name(f".tmp_{final.name}.{os.getpid()}")
    remove(tmp)
    try:
        yield tmp
        if final.is_dir() and tmp.is_dir():
            remove(final)
        os.replace(tmp, final)
    except BaseException as e:
        full = (
            isinstance(e, Exception) and not isinstance(e, OSError) and (says_full(e) or _disk_full(final.parent))
        )  # before the partial file is freed
        remove(tmp)
        if isinstance(e, OSError) or full:
            why = describe(e) if isinstance(e, OSError) else f"no space left on the device ({e})"
            raise StorageError(
                e.errno if isinstance(e, OSError) else errno.ENOSPC, f"could not write {what} to {final}: {why}"
            ) from e
        raise


def sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_text(path: Path, text: str) -> None:
    with staged(Path(path), Path(path).name) as tmp:
        tmp.write_text(text)


def remove(path: Path) -> None:
    """Remove a file, a link or a whole folder; nothing when it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def says_full(e: BaseException) -> bool:
    """Whether an error that is not an OSError reports a full disk in its message (safetensors'
    "No space left on device (os error 28)", torch's "file write failed"), its cause's included."""
    while e is not None:
        text = str(e)
        if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _disk_full(folder: Path, margin: int = 1 << 20) -> bool:
    """Whether the file system holding `folder` has (almost) no space left."""
    try:
        s = os.statvfs(folder)
    except OSError:
        return False
    return s.f_bavail * s.f_frsize < margin


MANIFEST = "manifest.json"  # in a folder written whole (a checkpoint, a cache entry): its files' SHA-256


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """`manifest.json` with the SHA-256 of every other file under `folder`, checked by `damage`."""
    manifest = {str(p.relative_to(folder)): sha256(p) for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when every file matches its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST} (written incompletely)"
    for name, digest in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if sha256(file) != digest:
            return f"{name} does not match its checksum"
    return None


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


def check_file_target(path: str | Path, key: str) -> None:
    """Before any work: `path` can become a file (it is not a directory, and its folder is
    writable), or fail naming the key."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        raise ConfigError(f"{key}: {path} is a directory; give the path of a file to write")
    check_writable(path.parent, key)


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
