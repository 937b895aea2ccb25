"""Running a study: every arm at every seed through `rlkit-train`, each run in its own process on
one thread, `jobs` at a time; a signal is forwarded to the runs in progress and no new one starts;
the pilot, then the plan (fixed once), then the planned seeds."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from rlkit import atomic
from rlkit.analysis.arms import planned_runs
from rlkit.analysis.budget import arm_hours, exhausted
from rlkit.analysis.decision import analyse, settled
from rlkit.analysis.records import check_declaration, check_logged, plan, read_plan, read_records, record, record_path
from rlkit.analysis.study import Stopped, StudySpec, overrides
from rlkit.analysis.values import Plan
from rlkit.exits import EXIT_DECISION, EXIT_PREEMPTED
from rlkit.signals import STOPS


class Signals:
    """While the study runs: SIGINT, SIGTERM or SIGHUP is forwarded once to each training run in progress
    (which checkpoints and exits 75), and no further run starts."""

    def __init__(self):
        self.procs, self.received = set(), None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in STOPS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, sig, frame) -> None:
        self.received = signal.Signals(sig).name
        for proc in list(self.procs):
            if proc.poll() is None:
                proc.send_signal(sig)


def start(spec: StudySpec, arm: str, seed: int, run_dir: Path, signals: Signals) -> subprocess.Popen:
    """One run through `rlkit-train` in its own process (so nothing carries over between runs), on
    one thread (so a study gives the same numbers however many runs share the machine); its output
    goes to `<run_dir>.log`. A rerun of an interrupted run resumes from its checkpoint. The run sits
    in a session of its own, so a signal to the study reaches it once, through `signals`; if the
    study is killed outright, so is the run."""
    cmd = [
        sys.executable,
        "-m",
        "rlkit.train",
        *overrides(spec, arm),
        f"seed={spec.seeds.first + seed}",  # the study's seed index, offset to the declared first run seed
        "threads=1",
        f"hydra.run.dir={run_dir}",
    ]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.log", "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
    signals.procs.add(proc)
    return proc


def die_with_parent() -> None:
    """In the child, before exec: on Linux, be killed when the study process dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def finished(running: dict, signals: Signals) -> tuple[subprocess.Popen, tuple]:
    """The first of the running processes to end, with what it was started for."""
    while True:
        for proc in running:
            if proc.poll() is not None:
                signals.procs.discard(proc)
                return proc, running.pop(proc)
        time.sleep(0.2)


def run_seeds(
    spec: StudySpec, name: str, seeds: int, runs: Path, results: Path, signals: Signals, jobs: int = 1
) -> None:
    """Every arm (and control) at each of the first `seeds` seeds that is not recorded yet, seed by seed (pairs
    complete early), `jobs` runs at a time. A failed or stopped run lets the others finish (and be
    recorded) and starts no new one."""
    todo = [(arm, seed) for arm, seed in planned_runs(spec, seeds) if not record_path(results, arm, seed).exists()]
    todo = longest_first(todo, read_records(results))
    running, stop = {}, None
    while todo or running:
        while todo and len(running) < jobs and stop is None and not signals.received:
            arm, seed = todo.pop(0)
            run_dir = runs / arm / f"seed_{seed}"
            running[start(spec, arm, seed, run_dir, signals)] = (arm, seed, run_dir, time.time())
        if not running:
            break
        proc, (arm, seed, run_dir, t0) = finished(running, signals)
        code = proc.returncode
        print(
            f"rlkit-study: {name}: {arm} seed {seed}: exit {code} in {time.time() - t0:.0f}s ({run_dir})",
            file=sys.stderr,
        )
        why = outcome(spec, name, results, signals, arm, seed, run_dir, code)  # records a finished run
        stop = stop or why
    if stop is not None:
        raise stop
    if todo:
        arm, seed = todo[0]
        raise Stopped(
            EXIT_PREEMPTED,
            f"{name}: stopped by {signals.received} before {arm} seed {seed}; rerun the same command to resume",
        )


def longest_first(todo: list, records: list) -> list:
    """The runs of each seed in the order of their arms' recorded run times, longest first (ties and
    arms not yet run in the declared order): with fewer jobs than arms the long run starts at once and
    the short ones share the other slots, so a seed ends when its longest run does."""
    mean = arm_hours(records)
    return sorted(todo, key=lambda run: (run[1], -mean.get(run[0], 0.0)))


def outcome(
    spec: StudySpec, name: str, results: Path, signals: Signals, arm: str, seed: int, run_dir: Path, code: int
) -> Stopped | None:
    """Record a finished run (exit 0, or 3: stopped by non-finite updates, kept and named); else why
    the study must stop."""
    if code in (0, 3) and (run_dir / "metrics.jsonl").exists():
        record(spec, results, arm, seed, run_dir, code)
        return None
    if code == EXIT_PREEMPTED or (signals.received and code < 0):  # < 0: hit before it could checkpoint
        return Stopped(
            EXIT_PREEMPTED,
            f"{name}: stopped by {signals.received or 'a signal'} during "
            f"{arm} seed {seed}; rerun the same command to resume",
        )
    return Stopped(
        code if code > 0 else 1,
        f"{name}: {arm} seed {seed} failed (exit {code}); see "
        f"{run_dir}.log. Fix the cause and rerun the same command: recorded runs are kept",
    )


def run_all(spec: StudySpec, name: str, runs: Path, results: Path, jobs: int = 1, to_cap: bool = False) -> None:
    """The pilot, the plan (fixed once), then the planned seeds, `jobs` runs at a time; a plan that
    foreseeably cannot decide stops for a decision (`to_cap` takes it: run to the cap)."""
    with Signals() as signals:
        run_planned(spec, name, runs, results, signals, jobs, to_cap)


def run_planned(
    spec: StudySpec, name: str, runs: Path, results: Path, signals: Signals, jobs: int, to_cap: bool
) -> None:
    check_declaration(spec, name, results, read_records(results))
    if spec.sequential:
        return run_sequential(spec, name, runs, results, signals, jobs)
    run_seeds(spec, name, spec.seeds.pilot, runs, results, signals, jobs)
    check_logged(spec, read_records(results))
    plan_file = results / "plan.json"
    if not plan_file.exists():  # fixed once, from the pilot alone; a resumed study keeps it
        atomic.write_text(plan_file, json.dumps(plan(spec, read_records(results)).to_json(), indent=1))
    fixed = read_plan(plan_file)
    print(
        f"rlkit-study: {name}: plan: {fixed.seeds} seeds per arm (needed {fixed.needed}, cap {fixed.cap})",
        file=sys.stderr,
    )
    if fixed.seeds > spec.seeds.pilot and fixed.undecidable and not fixed.to_cap:
        if not to_cap:
            raise Stopped(EXIT_DECISION, decision(name, fixed))
        atomic.write_text(plan_file, json.dumps(replace(fixed, to_cap=True).to_json(), indent=1))  # kept
    run_seeds(spec, name, fixed.seeds, runs, results, signals, jobs)


def run_sequential(spec: StudySpec, name: str, runs: Path, results: Path, signals: Signals, jobs: int) -> None:
    """A look after every completed seed from the first (`seeds.pilot`) to the cap; the study stops
    at the first look that settles it (`settled`). The looks are a function of the records alone,
    so a resumed or extended study takes the same ones."""
    for n in range(spec.seeds.pilot, spec.seeds.cap + 1):
        if n > spec.seeds.pilot and over_budget(spec, name, results, n - 1):
            return
        run_seeds(spec, name, n, runs, results, signals, jobs)
        if n == spec.seeds.pilot:
            check_logged(spec, read_records(results))
        looked = [(head, rows) for head, rows in read_records(results) if head["seed"] < n]
        why = settled(spec, analyse(spec, looked, None, robust=False))
        print(f"rlkit-study: {name}: look at {n} seeds: {why or 'not settled'}", file=sys.stderr)
        if why:
            return


def over_budget(spec: StudySpec, name: str, results: Path, seed: int) -> bool:
    """Whether the declared budget stops the study before `seed` (one already begun is finished)."""
    records = read_records(results)
    why = None if any(head["seed"] == seed for head, _ in records) else exhausted(spec, records)
    if why:
        print(f"rlkit-study: {name}: stopped before seed {seed}: {why}", file=sys.stderr)
    return why is not None


def decision(name: str, fixed: Plan) -> str:
    """Why the study stops after its pilot, and the two ways on."""
    limit = f"the cap of {fixed.cap}" if fixed.limit == fixed.cap else f"the {fixed.limit} the budget affords"
    why = [f"the plan needs {fixed.needed} seeds per arm, past {limit}"] if fixed.capped else []
    why += [f"the pilot fell short of the {gate}'s bound" for gate in fixed.short]
    needs = "; ".join(
        f"{what}: {n.needed if n.needed is not None else 'short'}" for what, n in {**fixed.arms, **fixed.gates}.items()
    )
    return (
        f"{name}: {' and '.join(why)} ({needs}), so running to the cap would foreseeably end inconclusive or not "
        f"tested. Decide: `rlkit-study {name} --to-cap` runs the planned {fixed.seeds} seeds anyway (kept in "
        "plan.json), or declare a new study (a higher cap, a stronger mechanism); the pilot's records are kept"
    )
