"""`rlkit-train` (and `python -m rlkit.train`): the Hydra app around `rlkit.session.run`. Exit codes:
0 done, 2 bad input (a config that does not compose or fails its checks, a bad task row), 3 too
many non-finite updates, 74 storage full, 75 stopped by a signal after a checkpoint (rerun the
same command to resume)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import rlkit.config  # noqa: F401  (registers `rlkit_schema`, the typed schema conf/config.yaml composes on)
from rlkit import atomic, parallel, rundir, sweeps
from rlkit.exits import EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_PREEMPTED, EXIT_STORAGE
from rlkit.guards import NonFiniteError
from rlkit.hardware import PORTABLE_ENV
from rlkit.refusals import ConfigError
from rlkit.signals import Preempted, StoppedAtOnce
from rlkit.tasks.base import TaskError

PEER_GRACE_S = 5.0


class ComposeCheck(Callback):
    """Notes that Hydra composed the config, so `rlkit-train` can tell a composition error (bad
    input, exit 2) from a failure inside a run. Before Hydra writes into a single run's directory
    it claims it (`rundir.claim`: the folders it makes, the lock, the `.hydra/` files an earlier run
    left), so that a refused run undoes only its own traces. A sweep's end names its failed jobs."""

    composed = False
    claim: rundir.Claim | None = None  # a single run's claim on its directory
    sweep_started = 0.0
    sweep_failed: tuple[int, str] | None = None  # (exit code, closing line) when jobs of the sweep failed

    def on_run_start(self, config, **kwargs) -> None:
        ComposeCheck.composed = True
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
        subdir = str(OmegaConf.select(config, "hydra.output_subdir") or ".hydra")
        try:  # the ranks of one launch share the directory; rank 0 holds its lock
            ComposeCheck.claim = rundir.claim(run_dir, subdir, lock=parallel.launch_rank() == 0)
        except ConfigError as e:
            print(f"rlkit: error: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)

    def on_multirun_start(self, config, **kwargs) -> None:
        ComposeCheck.composed = True
        ComposeCheck.sweep_started = time.time()

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        failed = sweeps.failures(sweep_dir, since=ComposeCheck.sweep_started)
        if failed:
            listed = sweeps.jobs(sweep_dir)
            ComposeCheck.sweep_failed = sweeps.summary(failed, len(listed) if listed is not None else None)


def hydra_run_info() -> dict:
    """Chosen options, and in a sweep its name, this run's overrides and threads per parallel job."""
    hc = HydraConfig.get()
    info = {"choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}}
    if hc.mode == RunMode.MULTIRUN:
        info.update(sweep=Path(hc.sweep.dir).name, name=hc.job.override_dirname or None, job=hc.job.num)
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


def ending(e: BaseException) -> tuple[int, str] | None:
    """The exit code and the one line `rlkit-train` prints for an error it reports without a
    traceback; None for any other error."""
    if isinstance(e, (ConfigError, TaskError)):
        return EXIT_BAD_INPUT, f"rlkit: error: {e}"
    if isinstance(e, NonFiniteError):
        return EXIT_NON_FINITE, f"rlkit: error: {e}"
    if isinstance(e, (Preempted, StoppedAtOnce)):
        return EXIT_PREEMPTED, f"rlkit: {e}"
    if isinstance(e, OSError) and atomic.storage_failed(e):
        return EXIT_STORAGE, (
            f"rlkit: error: {atomic.describe_write(e)}; earlier checkpoints are intact: free space and rerun the same "
            "command to resume"
        )
    if isinstance(e, Exception) and parallel.peer_failed(e):
        return 1, (
            "rlkit: error: another process of this run failed (its message is above); stopping this one "
            f"({type(e).__name__})"
        )
    return None


@hydra.main(version_base=None, config_path=config_path(), config_name="config")
def app(cfg: DictConfig) -> dict | None:
    hc = HydraConfig.get()
    run_dir, claim = hc.runtime.output_dir, ComposeCheck.claim
    info = {**hydra_run_info(), "earlier_hydra": claim.earlier_hydra() if claim else {}}
    from rlkit.session import run  # torch's models and kernels: after the config composed

    try:
        summary = run(cfg, run_dir, info, locked=claim is not None and claim.lock is not None)
    except Exception as e:
        if hc.mode == RunMode.MULTIRUN and not isinstance(e, Preempted):
            return sweep_job_failed(e, run_dir, hc)
        stop(e, claim)
    except StoppedAtOnce as e:
        stop(e, claim)
    if hc.mode == RunMode.MULTIRUN:
        sweeps.clear_failure(run_dir)
    return summary


def stop(e: BaseException, claim: rundir.Claim | None):
    """Exit with `e`'s code and line (a refused run undoing its claim first); a traceback for other errors."""
    ended = ending(e)
    if ended is None:
        raise e
    code, line = ended
    print(line, file=sys.stderr)
    if code == EXIT_BAD_INPUT and claim is not None and not isinstance(e, rundir.RunDirInUse):
        claim.undo()  # rank 0's part; the others wait, as the launcher stops every rank once one has ended
    if code == 1 or (code == EXIT_BAD_INPUT and parallel.launch_rank() > 0):
        time.sleep(PEER_GRACE_S)  # let the failing process (or rank 0, undoing) exit first
    sys.exit(code)


def sweep_job_failed(e: Exception, run_dir: str, hc) -> None:
    """A failed job of a sweep: its message (or traceback) printed, the failure recorded in its own
    folder (not in a folder another live run holds), and the sweep goes on."""
    ended = ending(e)
    if ended is None:
        traceback.print_exc()
    code, line = ended or (1, "".join(traceback.format_exception_only(type(e), e)))
    if ended is not None:
        print(line, file=sys.stderr)
    if not isinstance(e, rundir.RunDirInUse):
        error = line.removeprefix("rlkit: ").removeprefix("error: ")
        sweeps.record_failure(run_dir, hc.job.num, list(hc.overrides.task), code, error)
    return None


def main() -> None:
    """`rlkit-train`. A process of a data-parallel run ends through `parallel.exit_process`, with
    the status it would exit with, once its group is closed."""
    try:
        train()
    except BaseException as e:
        if not parallel.JOINED:
            raise
        parallel.exit_process(exit_status(e))
    if parallel.JOINED:
        parallel.exit_process(0)


def exit_status(e: BaseException) -> int:
    """The status Python would exit with on `e`, its message or traceback printed as Python would."""
    if isinstance(e, SystemExit) and (e.code is None or isinstance(e.code, int)):
        return e.code or 0
    if isinstance(e, SystemExit):
        print(e.code, file=sys.stderr)
    else:
        traceback.print_exception(e)
    return 1


def train() -> None:
    """Like `python -m`, puts the current directory on the import path, so a plugin module next to
    the user's configs imports. A config that does not compose exits 2, as other bad input does
    (Hydra's own message says why). `portable=true` pins torch's CPU kernels before any of them runs."""
    if any(a.lstrip("+").lower() == "portable=true" for a in sys.argv[1:]):
        for key, value in PORTABLE_ENV.items():  # read when torch, MKL and oneDNN first run a kernel
            os.environ.setdefault(key, value)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    sweeps.register_sweeper()
    launched = parallel.launch_time()
    if launched is not None:  # every rank resolves ${now:...} (the default run directory) to the same folder
        OmegaConf.register_new_resolver("now", launched.strftime, use_cache=True, replace=True)
    try:
        app()
        if ComposeCheck.sweep_failed is not None:
            code, line = ComposeCheck.sweep_failed
            print(line, file=sys.stderr)
            sys.exit(code)
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
