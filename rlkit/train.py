"""`rlkit-train` (and `python -m rlkit.train`): the Hydra app around `rlkit.session.run`. Exit codes:
0 done, 2 bad input (a config that does not compose or fails its checks, a bad task row), 3 too
many non-finite updates, 74 storage full, 75 stopped by a signal after a checkpoint (rerun the
same command to resume)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlkit import atomic, parallel
from rlkit.checkpoint import HYDRA_FILES
from rlkit.config import ConfigError
from rlkit.exits import EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_PREEMPTED, EXIT_STORAGE
from rlkit.guards import NonFiniteError
from rlkit.hardware import PORTABLE_ENV
from rlkit.locks import check_writable
from rlkit.session import run
from rlkit.signals import Preempted, StoppedAtOnce
from rlkit.tasks.base import TaskError

PEER_GRACE_S = 5.0


class ComposeCheck(Callback):
    """Notes that Hydra composed the config, so `rlkit-train` can tell a composition error (bad
    input, exit 2) from a failure inside a run. Before Hydra writes into the run directory it checks
    that the directory is writable (else exit 2 naming the key) and keeps the `.hydra/` files an
    earlier run left there, so that a refused run can put them back (`restore_hydra_files`)."""

    composed = False
    saved: dict = {}  # path -> bytes of the run directory's .hydra files before this run
    existed: set = set()  # the run directory and the folders above it that existed before this run

    def on_run_start(self, config, **kwargs) -> None:
        ComposeCheck.composed = True
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
        ComposeCheck.existed = {q for q in (run_dir.resolve(), *run_dir.resolve().parents) if q.is_dir()}
        try:
            check_writable(run_dir, "hydra.run.dir")
        except ConfigError as e:
            print(f"rlkit: error: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        hydra_dir = run_dir / str(OmegaConf.select(config, "hydra.output_subdir") or ".hydra")
        # the ranks of one launch write the same files: another rank's are not an earlier run's
        ComposeCheck.saved = (
            {p: p.read_bytes() for p in hydra_dir.glob("*.yaml") if not since_launch(p)} if hydra_dir.is_dir() else {}
        )

    def on_multirun_start(self, config, **kwargs) -> None:
        ComposeCheck.composed = True


def discard_refused(run_dir: str) -> None:
    """After a refused run: put back the `.hydra/` files an earlier run had in `run_dir`; or, when
    the directory holds nothing but Hydra's own files of this run, remove it and the folders above
    it that this run created, up to the working directory. With several processes, rank 0 alone
    does it (the others wrote the same files, and may have made the directory first)."""
    existed = ComposeCheck.existed
    if int(os.environ.get("RANK", "0")):
        return
    if ComposeCheck.saved:
        for p, data in ComposeCheck.saved.items():
            p.write_bytes(data)
        return
    path, cwd = Path(run_dir).resolve(), Path.cwd().resolve()
    ours = path not in existed or all(since_launch(f) for f in path.rglob("*"))
    if (
        path == cwd
        or cwd not in path.parents
        or not path.is_dir()
        or not {p.name for p in path.iterdir()} <= HYDRA_FILES
        or not ours
    ):
        return
    shutil.rmtree(path, ignore_errors=True)
    for parent in path.parents:
        if parent == cwd or parent in existed or any(parent.iterdir()):
            break
        parent.rmdir()


def since_launch(path: Path) -> bool:
    """Whether `path` was written since this launch of several processes started (never with one process)."""
    launched = parallel.launch_time()
    return launched is not None and path.stat().st_mtime >= launched.timestamp()


def earlier_hydra_files() -> dict:
    """The `.hydra/` files an earlier run left in the run directory (relative name -> bytes), which Hydra has
    now overwritten with this run's: `checkpoint.resume=false` moves them aside with that run."""
    return {f"{p.parent.name}/{p.name}": data for p, data in ComposeCheck.saved.items()}


def hydra_run_info() -> dict:
    """Chosen options, and in a sweep its name, this run's overrides and threads per parallel job."""
    hc = HydraConfig.get()
    info = {"choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}}
    if hc.mode == RunMode.MULTIRUN:
        info.update(sweep=Path(hc.sweep.dir).name, name=hc.job.override_dirname or None)
        jobs = OmegaConf.select(hc, "launcher.n_jobs")
        if jobs is not None:  # parallel jobs share the cores
            cores = os.cpu_count() or 1
            info["threads"] = max(1, cores // (cores if jobs < 1 else min(jobs, cores)))
    return info


def config_path() -> str:
    """The installed configs (`rlkit.conf`), or the checkout's `conf/` when `rlkit` is imported
    from a source tree that was not installed (for example `python -m rlkit.train` from the repo root
    next to a non-editable install)."""
    if importlib.util.find_spec("rlkit.conf") is not None:
        return "pkg://rlkit.conf"
    return str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base=None, config_path=config_path(), config_name="config")
def app(cfg: DictConfig) -> dict | None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        return run(cfg, run_dir, {**hydra_run_info(), "earlier_hydra": earlier_hydra_files()})
    except (ConfigError, TaskError) as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        discard_refused(run_dir)
        sys.exit(EXIT_BAD_INPUT)
    except NonFiniteError as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        sys.exit(EXIT_NON_FINITE)
    except (Preempted, StoppedAtOnce) as e:
        print(f"rlkit: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except OSError as e:
        if not atomic.storage_failed(e):
            raise
        print(
            f"rlkit: error: {atomic.describe_write(e)}; earlier checkpoints are intact: free space and rerun the same "
            "command to resume",
            file=sys.stderr,
        )
        sys.exit(EXIT_STORAGE)
    except Exception as e:
        if not parallel.peer_failed(e):
            raise
        print(
            f"rlkit: error: another process of this run failed (its message is above); stopping this one "
            f"({type(e).__name__})",
            file=sys.stderr,
        )
        time.sleep(PEER_GRACE_S)  # let the failing process exit first, so the launcher reports its own code
        sys.exit(1)


def main() -> None:
    """`rlkit-train`. Like `python -m`, puts the current directory on the import path, so a plugin
    module next to the user's configs imports. A config that does not compose exits 2, as other
    bad input does (Hydra's own message says why). `portable=true` pins torch's CPU kernels before
    any of them runs."""
    if any(a.lstrip("+").lower() == "portable=true" for a in sys.argv[1:]):
        for key, value in PORTABLE_ENV.items():  # read when torch, MKL and oneDNN first run a kernel
            os.environ.setdefault(key, value)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    launched = parallel.launch_time()
    if launched is not None:  # every rank resolves ${now:...} (the default run directory) to the same folder
        OmegaConf.register_new_resolver("now", launched.strftime, use_cache=True, replace=True)
    try:
        app()
    except SystemExit as e:
        if e.code == 1 and not ComposeCheck.composed:
            print(
                "rlkit: error: the overrides or config files above did not compose. A component's own options "
                "are listed by adding the key with '+' (e.g. +advantage.bogus=1); `rlkit-train --help` lists the "
                "groups and their options",
                file=sys.stderr,
            )
            sys.exit(EXIT_BAD_INPUT)
        raise


if __name__ == "__main__":  # run as the module `rlkit.train`, the one Hydra's callback (ComposeCheck) lives in
    from rlkit.train import main as module_main

    module_main()
