"""`rlkit-study`: a declared study run end to end. The study file (`experiments/<name>/study.yaml`)
fixes, before any run, the arms, the claim, the primary metric and its per-run aggregate, the
direction and smallest effect of interest, alpha and power, the secondary metrics, an engagement
check and the seed cap. The command runs a pilot of paired seeds, plans the seed count from the
pilot's spread at the declared smallest effect, runs the rest up to the cap, keeps every run's raw
metrics under `experiments/<name>/results/`, and writes the verdict into the study's README.
A killed study resumes where it stopped: recorded runs are kept, an interrupted run resumes from
its checkpoint, and the plan is never recomputed.

    rlkit-study length_bias                 # pilot, plan, runs, analysis, README
    rlkit-study length_bias --jobs 2        # two runs at a time (each on one thread): the same records
    rlkit-study length_bias --analyse-only  # recompute every number from results/ alone
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlkit import files, stats
from rlkit.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from rlkit.runs import parse_aggregate
from rlkit.verdict import per_run, runs_by_arm, write_report


@dataclass
class MetricSpec:
    metric: str = MISSING  # a logged metric, e.g. eval/accuracy
    aggregate: str = "last:3"  # each run's one number: final, last:K, auc, auc:tokens or best (after step 0)
    lower: bool = False  # lower values are better (lengths, losses)


@dataclass
class Primary(MetricSpec):
    direction: str = MISSING  # the claimed effect of each treatment against the baseline: higher, lower or equal
    smallest_effect: float = MISSING  # the smallest difference of interest; for `equal`, the equivalence margin


@dataclass
class Engagement(MetricSpec):
    at_least: float | None = None  # each treatment arm's mean aggregate must reach this ...
    at_most: float | None = None  # ... or stay below this, for the treatment to count as applied
    arm: str | None = None  # or this one arm's (e.g. the baseline's: the mechanism must bind there)


@dataclass
class Learning(MetricSpec):
    """The baseline arm must learn for any verdict to count: its mean `aggregate` of `metric` per
    run (by default held-out accuracy, the mean of the last 3 evaluations minus step 0) is above 0
    with its 95% interval."""

    metric: str = "eval/accuracy"
    aggregate: str = "gain:3"


@dataclass
class Seeds:
    pilot: int = 3  # paired seeds per arm run first; their spread plans the rest
    cap: int = 20  # most seeds per arm the study may spend
    pilot_confidence: float = 0.8  # the pilot's sd is raised to this upper confidence limit before planning


@dataclass
class StudySpec:
    claim: str = MISSING  # the published claim under test, in one or two sentences
    source: str = MISSING  # the paper (authors, year, arXiv id)
    config: list = field(
        default_factory=list
    )  # overrides every arm shares (the testbed), e.g. [+experiment=wide_testbed]
    arms: dict = MISSING  # arm name -> its own overrides; arms differ in one mechanism
    baseline: str = MISSING  # the arm the others are compared with
    primary: Primary = MISSING
    secondary: list = field(default_factory=list)  # MetricSpec entries, Holm-corrected together
    engagement: Engagement | None = None  # a metric that shows the treatment acted
    learning: Learning | None = None  # a check that the baseline learns at all; failing it, no verdict
    controls: dict = field(default_factory=dict)  # control arm name -> overrides (e.g. [reward.shuffle=group]),
    # run at the same seeds and reported beside the baseline on the learning metric, outside the tests
    alpha: float = 0.05
    power: float = 0.8
    seeds: Seeds = field(default_factory=Seeds)


class StudyError(ValueError):
    """A study file that cannot run as written."""


class Stopped(Exception):
    """The study stops here; `code` is its exit status."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def load_spec(path: Path) -> StudySpec:
    """The study file checked against `StudySpec`: unknown or missing keys and impossible values are named."""
    try:
        loaded = OmegaConf.load(path)
        check_lists(path, loaded)
        merged = OmegaConf.merge(OmegaConf.structured(StudySpec), loaded)
        merged.secondary = [OmegaConf.merge(OmegaConf.structured(MetricSpec), s) for s in merged.secondary]
        spec = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as e:
        raise StudyError(f"{path} cannot be read as a study file: {e}".strip()) from None
    problems = []
    if spec.baseline not in spec.arms or len(spec.arms) < 2:
        problems.append(f"baseline {spec.baseline!r} must be one of at least two arms (arms: {', '.join(spec.arms)})")
    if spec.primary.direction not in ("higher", "lower", "equal"):
        problems.append(f"primary.direction must be higher, lower or equal, got {spec.primary.direction!r}")
    if not spec.primary.smallest_effect > 0:
        problems.append("primary.smallest_effect must be > 0")
    if not (0 < spec.alpha < 0.5 and 0.5 <= spec.power < 1):
        problems.append(f"alpha must be in (0, 0.5) and power in [0.5, 1), got {spec.alpha}, {spec.power}")
    if not 2 <= spec.seeds.pilot <= spec.seeds.cap:
        problems.append(f"seeds need 2 <= pilot <= cap, got pilot {spec.seeds.pilot}, cap {spec.seeds.cap}")
    if set(spec.controls) & set(spec.arms):
        problems.append(f"a control may not share an arm's name: {', '.join(set(spec.controls) & set(spec.arms))}")
    if spec.controls and spec.learning is None:
        problems.append("controls are compared with the baseline on the learning metric: declare `learning` too")
    if spec.engagement is not None and (spec.engagement.at_least is None) == (spec.engagement.at_most is None):
        problems.append("engagement needs exactly one of at_least and at_most")
    if spec.engagement is not None and spec.engagement.arm not in (None, *spec.arms):
        problems.append(f"engagement.arm {spec.engagement.arm!r} is not one of the arms ({', '.join(spec.arms)})")
    for m in [spec.primary, *spec.secondary, *[c for c in (spec.engagement, spec.learning) if c is not None]]:
        try:
            parse_aggregate(m.aggregate)
        except ValueError as e:
            problems.append(f"{m.metric}: {e}")
    if problems:
        raise StudyError(f"{path}: " + "; ".join(problems))
    return spec


def check_lists(path: Path, loaded) -> None:
    """The shared overrides and each arm's are lists (a string would be taken apart into characters)."""
    if not OmegaConf.is_dict(loaded) or not OmegaConf.is_dict(loaded.get("arms", {})):
        raise StudyError(f"{path}: a study file is a mapping whose `arms` map each arm's name to its overrides")
    arms = [(f"{group}.{a}", o) for group in ("arms", "controls") for a, o in (loaded.get(group) or {}).items()]
    for where, value in [("config", loaded.get("config", [])), *arms]:
        if not (OmegaConf.is_list(value) or isinstance(value, list)):
            raise StudyError(f"{path}: {where} must be a list of overrides, e.g. [algo=grpo], got {value!r}")


# ---- what is recorded: one gzipped JSON-lines file per finished run -------------------------------------------


def record_path(results: Path, arm: str, seed: int) -> Path:
    return results / "runs" / f"{arm}_seed{seed}.jsonl.gz"


def every_arm(spec: StudySpec) -> dict:
    """The arms under test and the control arms: name -> own overrides."""
    return {**spec.arms, **spec.controls}


def overrides(spec: StudySpec, arm: str) -> list[str]:
    return [*spec.config, *every_arm(spec)[arm]]


def record(spec: StudySpec, results: Path, arm: str, seed: int, run_dir: Path, exit_code: int) -> None:
    """The run's metrics, config and hardware, written whole (a kill leaves no half file)."""
    meta = json.loads((run_dir / "run.json").read_text())
    body = (run_dir / "metrics.jsonl").read_text()
    head = {
        "arm": arm,
        "seed": seed,
        "exit": exit_code,
        "finished": (run_dir / "summary.json").exists(),
        "overrides": overrides(spec, arm),
        "declared": declared(spec),
        "rows": len(body.splitlines()),
        "choices": meta["choices"],
        "config": meta["config"],
        "hardware": meta.get("hardware"),
    }
    path = record_path(results, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.staged(path, path.name) as tmp:
        tmp.write_bytes(gzip.compress((json.dumps(head) + "\n" + body).encode(), mtime=0))


def read_records(results: Path) -> list[tuple[dict, list[dict]]]:
    """Every recorded run: (head, metric rows). A damaged record (cut short, re-packed after a cut,
    not JSON) stops the analysis naming every such file; the intact ones are not touched."""
    out, damaged = [], []
    paths = sorted((results / "runs").glob("*.jsonl.gz"))
    for path in paths:
        try:
            lines = gzip.decompress(path.read_bytes()).decode().splitlines()
            head, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
            if not isinstance(head, dict) or {"arm", "seed", "finished"} - set(head):
                raise ValueError("its first line is not a record's head")
            if "rows" in head and head["rows"] != len(rows):
                raise ValueError(f"it holds {len(rows)} metric rows of the {head['rows']} recorded")
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError, IndexError) as e:
            damaged.append(f"{path} ({type(e).__name__}: {e})")
            continue
        out.append((head, rows))
    if damaged:
        raise Stopped(
            EXIT_BAD_INPUT,
            f"damaged record(s): {'; '.join(damaged)}. Restore them from version control, "
            f"or delete them and rerun `rlkit-study` without --analyse-only to run those arms and seeds "
            f"again; the other {len(paths) - len(damaged)} records are intact and kept",
        )
    return out


# ---- running -------------------------------------------------------------------------------------------------------


class Signals:
    """While the study runs: SIGINT or SIGTERM is forwarded once to each training run in progress
    (which checkpoints and exits 75), and no further run starts."""

    def __init__(self):
        self.procs, self.received = set(), None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
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
        f"seed={seed}",
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
    spec: StudySpec, name: str, seeds: range, runs: Path, results: Path, signals: Signals, jobs: int = 1
) -> None:
    """Every arm (and control) at every seed in `seeds` that is not recorded yet, seed by seed (pairs
    complete early), `jobs` runs at a time. A failed or stopped run lets the others finish (and be
    recorded) and starts no new one."""
    todo = [(arm, seed) for seed in seeds for arm in every_arm(spec) if not record_path(results, arm, seed).exists()]
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
        if code in (0, 3) and (run_dir / "metrics.jsonl").exists():  # 3: stopped by non-finite updates; kept, named
            record(spec, results, arm, seed, run_dir, code)
        elif code == EXIT_PREEMPTED or (signals.received and code < 0):  # < 0: hit before it could checkpoint
            stop = stop or Stopped(
                EXIT_PREEMPTED,
                f"{name}: stopped by {signals.received or 'a signal'} during "
                f"{arm} seed {seed}; rerun the same command to resume",
            )
        else:
            stop = stop or Stopped(
                code if code > 0 else 1,
                f"{name}: {arm} seed {seed} failed (exit {code}); see "
                f"{run_dir}.log. Fix the cause and rerun the same command: recorded runs are kept",
            )
    if stop is not None:
        raise stop
    if todo:
        arm, seed = todo[0]
        raise Stopped(
            EXIT_PREEMPTED,
            f"{name}: stopped by {signals.received} before {arm} seed {seed}; rerun the same command to resume",
        )


def plan(spec: StudySpec, records: list) -> dict:
    """Seeds per arm from the pilot's paired spread, inflated to its upper confidence limit, at the
    declared smallest effect (an equivalence margin for `equal`); Bonferroni over the treatments."""
    pilot = [(head, rows) for head, rows in records if head["seed"] < spec.seeds.pilot]  # a replan gives the same plan
    values = per_run(runs_by_arm(pilot)[0], spec.primary)
    treatments = [a for a in spec.arms if a != spec.baseline]
    alpha = spec.alpha / len(treatments)
    out = {
        "pilot_seeds": spec.seeds.pilot,
        "cap": spec.seeds.cap,
        "alpha_for_planning": alpha,
        "arms": {},
        "declared": declared(spec),
    }
    for arm in treatments:
        pairs = [(values[spec.baseline][s], values[arm][s]) for s in values[arm] if s in values[spec.baseline]]
        d = stats.paired([a for a, _ in pairs], [b for _, b in pairs])
        sd = stats.inflated_sd(d.sd, d.n, spec.seeds.pilot_confidence) if d.n >= 2 else float("nan")
        if spec.primary.direction == "equal":
            need = stats.seeds_for_equivalence(spec.primary.smallest_effect, sd, spec.power, alpha)
        else:
            need = stats.seeds_for_power(spec.primary.smallest_effect, sd, True, spec.power, alpha)
        out["arms"][arm] = {
            "pilot_pairs": d.n,
            "pilot_sd": d.sd,
            "planning_sd": sd,
            "needed": need if need is not None else spec.seeds.pilot,
        }
    needed = max(a["needed"] for a in out["arms"].values())
    out.update(needed=needed, seeds=min(spec.seeds.cap, max(spec.seeds.pilot, needed)), capped=needed > spec.seeds.cap)
    return out


def declared(spec: StudySpec) -> dict:
    """The whole declaration as plain data: the plan and every record keep it, and a study file that
    no longer says the same is refused, for new runs and for the analysis alike."""
    return json.loads(json.dumps(OmegaConf.to_container(OmegaConf.structured(spec))))


def with_defaults(was: dict) -> dict:
    """A kept declaration with the keys the study schema gained since at their defaults (a study
    file that never named them still declares the same), so only what was said is compared."""
    try:
        return json.loads(json.dumps(OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(StudySpec), was))))
    except OmegaConfBaseException:  # a key the schema no longer has: compared as it was kept
        return was


def changes(was: dict, now: dict, prefix: str = "") -> list[str]:
    """'key: old -> new' for every leaf where two declarations differ."""
    out = []
    for k in sorted(set(was) | set(now), key=str):
        a, b = was.get(k, "(absent)"), now.get(k, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def check_declaration(spec: StudySpec, name: str, results: Path, records: list) -> None:
    """The study file says what the runs were made under: the overrides of every recorded run's arm,
    and the declaration kept with the plan and with each record. An edit after the runs would
    otherwise change the verdict (or the README's protocol) silently."""
    fix = (
        "restore the study file (e.g. `git checkout` it); a changed declaration is a new study: copy it to a new "
        "folder and run that"
    )
    for head, _ in records:
        known = head["arm"] in every_arm(spec)
        if not known or head.get("overrides") != overrides(spec, head["arm"]):
            raise Stopped(
                EXIT_BAD_INPUT,
                f"{name}: {head['arm']} seed {head['seed']} was recorded with overrides "
                f"{head.get('overrides')}, but the study file now says "
                f"{overrides(spec, head['arm']) if known else 'no such arm'}; {fix}",
            )
    plan_file, now = results / "plan.json", declared(spec)
    kept = [(str(plan_file), read_plan(plan_file)["declared"])] if plan_file.exists() else []
    kept += [(f"the record of {h['arm']} seed {h['seed']}", h["declared"]) for h, _ in records if "declared" in h]
    for where, was in kept:
        was = with_defaults(was)
        if was != now:
            raise Stopped(
                EXIT_BAD_INPUT,
                f"{name}: the study file differs from the declaration in {where}, under "
                f"which the runs were made: {'; '.join(changes(was, now))}; {fix}",
            )


def read_plan(path: Path) -> dict:
    """The plan fixed from the pilot; a damaged file is named with what to do."""
    try:
        plan_ = json.loads(path.read_text())
        if not isinstance(plan_, dict) or {"seeds", "declared"} - set(plan_):
            raise ValueError("not a plan")
        return plan_
    except (OSError, ValueError) as e:
        raise Stopped(
            EXIT_BAD_INPUT,
            f"{path} is damaged ({type(e).__name__}: {e}): restore it from version "
            "control, or delete it and rerun `rlkit-study` without --analyse-only, which fixes the plan "
            "again from the pilot's records (the same plan)",
        ) from None


def check_logged(spec: StudySpec, records: list) -> None:
    """Every declared metric was logged by the pilot's runs (the engagement metric by a treatment
    arm's), so a misspelled name stops the study before it spends the rest of its seeds."""
    logged: dict[str, set] = {}
    for head, rows in records:
        logged.setdefault(head["arm"], set()).update(k for row in rows for k in row)
    everywhere = set.union(*logged.values()) if logged else set()
    missing = [
        m.metric
        for m in [spec.primary, *spec.secondary, *([spec.learning] if spec.learning else [])]
        if m.metric not in everywhere
    ]
    e = spec.engagement
    if e is not None and not any(
        e.metric in logged.get(a, ()) for a in ([e.arm] if e.arm else spec.arms) if e.arm or a != spec.baseline
    ):
        missing.append(spec.engagement.metric)
    if missing:
        raise Stopped(
            EXIT_BAD_INPUT,
            f"no pilot run logged {', '.join(missing)}; logged: {', '.join(sorted(everywhere - {'step'}))[:1500]}",
        )


def study_paths(target: str) -> tuple[str, Path]:
    """(name, study file) from a study name under ./experiments or a path to a study file or its folder."""
    p = Path(target)
    if p.suffix in (".yaml", ".yml"):
        path = p
    else:
        path = p / "study.yaml" if p.is_dir() else Path("experiments", target, "study.yaml")
    if not path.exists():
        raise StudyError(f"no study file {path}; a study is experiments/<name>/study.yaml (or give its path)")
    return path.parent.name, path


def run_all(spec: StudySpec, name: str, runs: Path, results: Path, jobs: int = 1) -> None:
    """The pilot, the plan (fixed once), then the planned seeds, `jobs` runs at a time."""
    with Signals() as signals:
        run_planned(spec, name, runs, results, signals, jobs)


def run_planned(spec: StudySpec, name: str, runs: Path, results: Path, signals: Signals, jobs: int) -> None:
    check_declaration(spec, name, results, read_records(results))
    run_seeds(spec, name, range(spec.seeds.pilot), runs, results, signals, jobs)
    check_logged(spec, read_records(results))
    plan_file = results / "plan.json"
    if not plan_file.exists():  # fixed once, from the pilot alone; a resumed study keeps it
        files.write_text(plan_file, json.dumps(plan(spec, read_records(results)), indent=1))
    fixed = read_plan(plan_file)
    print(
        f"rlkit-study: {name}: plan: {fixed['seeds']} seeds per arm (needed {fixed['needed']}, cap {fixed['cap']})",
        file=sys.stderr,
    )
    run_seeds(spec, name, range(fixed["seeds"]), runs, results, signals, jobs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlkit-study",
        description="Run a declared study end to end: pilot, plan, "
        "runs, analysis and the verdict in the study's README.",
    )
    p.add_argument("study", help="a study name (experiments/<name>/study.yaml) or the path of a study file")
    p.add_argument("--runs", type=Path, help="where run directories go (default: outputs/studies/<name>)")
    p.add_argument("--analyse-only", action="store_true", help="no runs: recompute the analysis from results/")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each on one thread (default 1); the records and the verdict are the same for any number",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.jobs < 1:
        parser().error(f"--jobs must be >= 1, got {a.jobs}")
    try:
        name, path = study_paths(a.study)
        spec = load_spec(path)
    except StudyError as e:
        print(f"rlkit-study: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    results, runs = path.parent / "results", a.runs or Path("outputs", "studies", name)
    try:
        if not a.analyse_only:
            run_all(spec, name, runs, results, a.jobs)
        records, plan_file = read_records(results), results / "plan.json"
        check_declaration(spec, name, results, records)
        fixed = read_plan(plan_file) if plan_file.exists() else None
    except Stopped as e:
        print(f"rlkit-study: {'error: ' if e.code != EXIT_PREEMPTED else ''}{e}", file=sys.stderr)
        return e.code
    if not records:
        print(f"rlkit-study: error: {name}: no recorded runs in {results / 'runs'}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(write_report(spec, name, path, results, records, fixed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
