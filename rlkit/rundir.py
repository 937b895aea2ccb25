"""Who owns a run directory: the one module that creates, locks and tidies it. `rlkit-train`
claims it before Hydra writes anything there: the folders it makes itself, the lock (rank 0), and
what an earlier run left (its names and its `.hydra/` files). A refused run undoes exactly what its
claim added, while it still holds the lock, and never touches what another process may own: a
directory another live run holds is refused before anything is written, and one that another
process made or wrote into is left as it is. The run that holds the lock removes dead writers'
temporary files, and a run that starts over sets the earlier run's files aside (`set_aside`);
checkpoints inside it are `rlkit.checkpoint`'s."""

from __future__ import annotations

import fcntl
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlkit import atomic, parallel
from rlkit.refusals import ConfigError

HYDRA_FILES = {".hydra", "train.log", ".rlkit.lock"}  # what Hydra and the lock write for every run
PREVIOUS = "previous_runs"  # where an earlier run's files go when a run starts over


class RunDirInUse(ConfigError):
    """The run directory is held by another live run: a refusal that must touch nothing there."""


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


@dataclass
class Claim:
    path: Path  # the run directory, resolved
    made: list = field(default_factory=list)  # folders this process created, outermost first
    before: set = field(default_factory=set)  # names in the directory before this run (an earlier run's)
    hydra: dict = field(default_factory=dict)  # path -> bytes of the earlier run's .hydra files
    lock: RunDirLock | None = None  # held by rank 0 until the process ends

    def earlier_hydra(self) -> dict:
        """The earlier run's `.hydra/` files by relative name (`set_aside` keeps them)."""
        return {f"{p.parent.name}/{p.name}": data for p, data in self.hydra.items()}

    def undo(self) -> None:
        """After a refusal: the earlier run's `.hydra/` files put back, and what this run added (its
        Hydra files, the lock file, the folders it made) removed; nothing at all when the directory
        holds anything else (this run wrote results there, or another process did)."""
        if self.lock is None:  # rank 0 alone: the other ranks wrote the same files
            return
        if not self.path.is_dir() or not {p.name for p in self.path.iterdir()} <= self.before | HYDRA_FILES:
            return
        for name in HYDRA_FILES - self.before:
            atomic.remove(self.path / name)
        for p, data in self.hydra.items():
            p.write_bytes(data)
        ours = self.made or ([self.path] if not self.before and made_by_launch(self.path) else [])
        for folder in reversed(ours):
            if any(folder.iterdir()):
                break
            folder.rmdir()


def claim(run_dir: str | Path, hydra_subdir: str, lock: bool = True) -> Claim:
    """Make `run_dir` (recording which folders this process made), take its lock when `lock`, and
    keep what an earlier run left there. A directory another live run holds raises `RunDirInUse`
    having written nothing; one that cannot be written raises ConfigError naming hydra.run.dir."""
    path = Path(run_dir).expanduser().resolve()
    for _ in range(10):  # a refused run may remove the folder between our mkdir and our lock
        try:
            made = make_dirs(path)
            before = {p.name for p in path.iterdir() if not since_launch(p)}
            held = RunDirLock(path).__enter__() if lock else None
            break
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"hydra.run.dir: directory {path} is not writable ({e.strerror or e})") from e
    else:
        raise ConfigError(f"hydra.run.dir: {path} keeps being removed by another process")
    hydra_dir = path / hydra_subdir
    files = sorted(hydra_dir.glob("*.yaml")) if hydra_subdir in before and hydra_dir.is_dir() else []
    return Claim(path, made, before, {p: p.read_bytes() for p in files if not since_launch(p)}, held)


def make_dirs(path: Path) -> list[Path]:
    """`mkdir -p path`, returning the folders this call made (outermost first); a folder another
    process made in between is not counted."""
    made = []
    for p in [*reversed(path.parents), path]:
        if p.is_dir():
            continue
        try:
            p.mkdir()
        except FileExistsError:
            continue
        made.append(p)
    return made


def since_launch(path: Path) -> bool:
    """Whether `path` was written since this launch of several processes started (never with one process)."""
    launched = parallel.launch_time()
    return launched is not None and path.stat().st_mtime >= launched.timestamp()


def made_by_launch(path: Path) -> bool:
    """Under a launch of several processes, whether everything in `path` is from this launch (so
    another rank of it may have made the folder)."""
    return parallel.launch_time() is not None and all(since_launch(p) for p in path.rglob("*"))


def remove_stale_temporaries(run_dir: str | Path) -> None:
    """Temporary files and folders of writers that died mid-write (`.tmp_<name>.<pid>`, a whole model
    copy for a checkpoint). Called by the run that holds the directory's lock, so no live writer owns them."""
    for folder in (Path(run_dir), Path(run_dir) / "checkpoints"):
        for tmp in folder.glob(".tmp_*"):
            if tmp.name.rsplit(".", 1)[-1] != str(os.getpid()):
                atomic.remove(tmp)


def set_aside(run_dir: str, earlier_hydra: dict | None = None) -> Path | None:
    """Starting over (`checkpoint.resume=false`) in a directory that holds an earlier run: its files
    (checkpoints, metrics, summary, wandb) move to `previous_runs/<time>/`, so nothing of it mixes
    with the new run and nothing is deleted. `earlier_hydra` (relative name -> bytes) holds the
    earlier run's `.hydra/` files, which Hydra has already overwritten with this run's; they are
    written back there."""
    old = [p for p in Path(run_dir).iterdir() if p.name not in HYDRA_FILES | {PREVIOUS}]
    if not old:
        return None
    dest = Path(run_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S"))
    dest = next(
        d for d in (dest.with_name(f"{dest.name}{'' if i == 0 else f'_{i}'}") for i in range(1000)) if not d.exists()
    )
    dest.mkdir(parents=True)
    for p in old:
        os.replace(p, dest / p.name)
    for name, data in (earlier_hydra or {}).items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
    print(f"rlkit: checkpoint.resume=false: the earlier run's files in {run_dir} moved to {dest}", file=sys.stderr)
    return dest
