"""rlkit's commands run as a user runs them, in a subprocess: the command line of a fast training
run, running a command to its end, the metrics a run logged (timing keys left out) and waiting on
a run in progress."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import FAST

TIMING = ("time/", "perf/")
TESTS = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
TRAIN = (sys.executable, "-m", "rlkit.train")


def command(run_dir, cache, *extra) -> list[str]:
    """A fast training run into `run_dir`, warm-started from (or into) `cache`."""
    return [*TRAIN, *FAST, f"warm_start.cache_dir={cache}", f"hydra.run.dir={run_dir}", *extra]


def run_cli(args, cwd=None, env=None, timeout=300, exe=TRAIN) -> subprocess.CompletedProcess:
    """`exe args` to its end, with the tests folder importable (plugins, helpers) and wandb offline."""
    env = {**os.environ, "PYTHONPATH": TESTS, "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([*exe, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def train(run_dir, cache, *extra, env=None) -> subprocess.CompletedProcess:
    """A fast training run (`command`) to its end."""
    return run_cli(command(run_dir, cache, *extra), env=env, exe=())


def sweep(sweep_dir, cache, *overrides, jobs: int = 2) -> subprocess.CompletedProcess:
    """A fast Hydra multirun (`-m`) of the overrides to its end: `jobs` at a time (joblib), or with
    `jobs=1` one after another in the command's process (Hydra's basic launcher, the default)."""
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"] if jobs > 1 else []
    return run_cli(
        ["-m", *FAST, *overrides, *launcher, f"hydra.sweep.dir={sweep_dir}", f"warm_start.cache_dir={cache}"],
        timeout=600,
    )


def metrics(run_dir) -> list[dict]:
    """Every logged step of `run_dir/metrics.jsonl`, without the timing keys."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(TIMING)} for line in lines]


def wait_for(cond, proc, timeout=180) -> None:
    """Until `cond()` holds; fails when `proc` ends first or after `timeout` seconds."""
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.01)
