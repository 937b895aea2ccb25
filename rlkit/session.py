"""One training run's life as a process: join the process group, check the config, hold the run
directory's lock and the stop signals, build the run (`setup`), repeat `loop.step` and
`loop.report`, checkpoint when due or when stopped, and write the summary."""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from omegaconf import DictConfig

from rlkit import atomic, checkpoint, parallel
from rlkit.guards import NonFiniteError
from rlkit.loop import report, step
from rlkit.preflight import check_portable
from rlkit.progress import Display
from rlkit.refusals import ConfigError
from rlkit.rundir import RunDirLock
from rlkit.setup import Validated, setup, validate
from rlkit.signals import Preempted, StopSignals
from rlkit.state import Run


def run(cfg: DictConfig, run_dir: str, run_info: dict | None = None, locked: bool = False) -> dict:
    """Train as `cfg` says, writing to `run_dir`; `run_info` carries the chosen options (`choices`)
    and sweep name for the logger. `locked`: the caller holds the run directory's lock already
    (`rlkit-train` takes it before Hydra writes there); else rank 0 takes it here."""
    t0 = time.perf_counter()
    rank, world = parallel.init(cfg.device)
    agreed, validated = False, None  # agreed: every rank ends here the same way
    try:
        validated = validate(cfg, world, rank)  # every check that needs no model, before anything is built or written
        summary = run_steps(cfg, validated, run_dir, run_info or {}, rank, t0, locked)
        agreed = True
        return summary
    except (Preempted, NonFiniteError):  # decided on every rank after the same step
        agreed = True
        raise
    except ConfigError:  # the config's own checks refuse it on every rank alike, each past writing its Hydra files
        agreed = validated is None
        raise
    finally:
        parallel.close(agreed)  # agreed: after a barrier, so rank 0 undoes a refused run's traces once all are written


def run_steps(
    cfg: DictConfig, validated: Validated, run_dir: str, run_info: dict, rank: int, t0: float, locked: bool
) -> dict:
    check_portable(cfg.portable)
    atomic.check_writable(run_dir, "hydra.run.dir")
    with (
        RunDirLock(run_dir) if rank == 0 and not locked else nullcontext(),
        StopSignals() as stop,
    ):  # SIGTERM/SIGINT/SIGHUP: finish the step
        run = setup(cfg, run_dir, run_info, validated, stop)
        run.runtime.t0 = t0
        if stop.received:
            raise Preempted(f"stopped by {stop.received} before the first step; rerun the same command to start")
        start = run.progress.start
        display = Display(start, cfg.steps, run_dir) if rank == 0 else None
        if display is not None and start == 0:
            display.line(f"rlkit: step 0/{cfg.steps}: held-out accuracy {run.progress.first_eval['eval/accuracy']:.3f}")
        for n in range(start + 1, cfg.steps + 1):
            done = step(run, n)
            metrics = report(run, n, done)
            if display is not None:
                held_out = run.progress.last_eval["eval/accuracy"]
                display.step(n, metrics.get("train/reward"), held_out, evaluated="eval/accuracy" in metrics)
            stopping = parallel.any_rank(bool(stop.received))  # every rank stops after the same step
            if n == cfg.steps or (cfg.checkpoint.every and n % cfg.checkpoint.every == 0) or stopping:
                t = time.perf_counter()
                path = checkpoint.save_run(run, n)
                run.runtime.spend("checkpoint", time.perf_counter() - t)
            if stopping:
                run.runtime.logger.finish()
                raise Preempted(
                    f"stopped by {stop.received or 'a signal to another rank'} after step {n}; "
                    f"checkpoint {path}; rerun the same command (same hydra.run.dir) to resume"
                )
            run.runtime.guard.record(done.stats.skipped, n)
        if display is not None:
            display.close()
        run.runtime.logger.finish()
        return write_summary(run, display)


def accounts(rt) -> dict:
    """This session's wall seconds by what they went to: building (models, data, warm start), the
    steps, evaluations, checkpoints, and `other` (checks, logging, the summary), which with them sums
    to `total`."""
    total = time.perf_counter() - rt.t0
    spent = {k: round(v, 2) for k, v in rt.spent.items()}
    return {**spent, "other": round(total - sum(rt.spent.values()), 2), "total": round(total, 2)}


def write_summary(run: Run, display: Display | None = None) -> dict:
    """summary.json and the closing line; wall time counts every session of the run, set-up included.
    A rerun of a finished run keeps its summary."""
    rt, p, steps = run.runtime, run.progress, run.cfg.steps
    path = Path(rt.run_dir, "summary.json")
    if rt.rank:
        return {}
    if p.finished_before and path.exists():
        print(f"rlkit: the run in {rt.run_dir} had already finished at step {p.start}; nothing to do", file=sys.stderr)
        return json.loads(path.read_text())
    summary = {
        "accuracy_before": p.first_eval["eval/accuracy"],
        "accuracy_after": p.last_eval["eval/accuracy"],
        "steps": steps,
        "wall_s": round(run.wall_s(), 1),
        "session_s": accounts(rt),
    }
    atomic.write_text(path, json.dumps(summary, indent=1))
    line = (
        f"rlkit: held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} "
        f"in {summary['wall_s']:.0f}s over {steps} steps ({rt.run_dir})"
    )
    display.line(line) if display is not None else print(line, file=sys.stderr)
    return summary
