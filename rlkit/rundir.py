"""Who owns a run directory. `rlkit-train` claims it before Hydra writes anything there: the
folders it makes itself, the lock (rank 0), and what an earlier run left (its names and its
`.hydra/` files). A refused run undoes exactly what its claim added, while it still holds the lock,
and never touches what another process may own: a directory another live run holds is refused
before anything is written, and one that another process made or wrote into is left as it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlkit import atomic, parallel
from rlkit.locks import RunDirLock
from rlkit.refusals import ConfigError

HYDRA_FILES = {".hydra", "train.log", ".rlkit.lock"}  # what Hydra and the lock write for every run


@dataclass
class Claim:
    path: Path  # the run directory, resolved
    made: list = field(default_factory=list)  # folders this process created, outermost first
    before: set = field(default_factory=set)  # names in the directory before this run (an earlier run's)
    hydra: dict = field(default_factory=dict)  # path -> bytes of the earlier run's .hydra files
    lock: RunDirLock | None = None  # held by rank 0 until the process ends

    def earlier_hydra(self) -> dict:
        """The earlier run's `.hydra/` files by relative name (`checkpoint.set_aside` keeps them)."""
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
