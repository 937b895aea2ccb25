"""A Hydra sweep's jobs and their failures. A job that fails records why in its own folder
(`failed.json`: exit code, last error line, job number and overrides) and the sweep goes on with
the next job; at the end `rlkit-train -m` names the failed jobs and exits non-zero, and
`rlkit-compare` lists failed and missing jobs beside the runs it compares."""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from rlkit import atomic

FAILED = "failed.json"


def record_failure(job_dir: str | Path, job: int | None, overrides: list[str], code: int, error: str) -> None:
    """Write `job_dir/failed.json`: the job's number and overrides, its exit code and last error line."""
    line = next((l for l in reversed(error.strip().splitlines()) if l.strip()), "")
    record = {"job": job, "overrides": overrides, "exit_code": code, "error": line, "time": time.time()}
    atomic.write_text(Path(job_dir, FAILED), json.dumps(record, indent=1))


def clear_failure(job_dir: str | Path) -> None:
    """A job that finished removes the failure an earlier try of it recorded."""
    Path(job_dir, FAILED).unlink(missing_ok=True)


def failures(sweep_dir: str | Path, since: float = 0.0) -> list[tuple[Path, dict]]:
    """(job folder, record) of each failure recorded under `sweep_dir` since `since`, by job number;
    a record that cannot be read is returned as such."""
    out = []
    for path in sorted(Path(sweep_dir).rglob(FAILED)):
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            record = {"job": None, "overrides": [], "exit_code": None, "error": f"unreadable {FAILED} ({e})"}
        if record.get("time", since) >= since:
            out.append((path.parent, record))
    return sorted(out, key=lambda item: (item[1].get("job") is None, item[1].get("job") or 0))


def register_sweeper() -> None:
    """Make rlkit's sweeper (`hydra/sweeper=rlkit`) known to Hydra's plugin registry even where
    Hydra's scan of the `hydra_plugins` namespace cannot see it (an editable install)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.rlkit_sweeper import RlkitSweeper

    Plugins.instance().class_name_to_class.setdefault(
        f"{RlkitSweeper.__module__}.{RlkitSweeper.__name__}", RlkitSweeper
    )


def jobs(sweep_dir: str | Path) -> list[list[str]] | None:
    """Each job's overrides, in job-number order, from the sweep's `multirun.yaml` as Hydra's basic
    sweeper (or rlkit's, which expands alike) expands it; None when there is no such file or another
    sweeper ran it."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = Path(sweep_dir, "multirun.yaml")
    try:
        cfg = OmegaConf.load(path)
        if not str(OmegaConf.select(cfg, "hydra.sweeper._target_")).endswith(("BasicSweeper", "RlkitSweeper")):
            return None
        params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        args = [f"{k}={v}" for k, v in params.items()] + list(OmegaConf.select(cfg, "hydra.overrides.task") or [])
        (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
        return batch
    except Exception:  # no file, a damaged one, or overrides only another sweeper reads
        return None


def summary(records: list[tuple[Path, dict]], total: int | None) -> tuple[int, str]:
    """The sweep's exit code (the jobs' own when they all failed alike, else 1) and its closing line."""
    codes = {r.get("exit_code") for _, r in records}
    code = codes.pop() if len(codes) == 1 and None not in codes else 1
    of = f" of {total}" if total is not None else ""
    named = "; ".join(f"job {r.get('job')} in {d} (exit {r.get('exit_code')}: {r.get('error')})" for d, r in records)
    return code, f"rlkit: {len(records)}{of} jobs failed, the others ran: {named}"
