"""A study's runs by arm and seed: its records read back as runs (the starting policy's, with
`baseline: start`), each reduced to one number per declared metric, paired by seed with the
baseline's; and the runs a study plans and still owes."""

from __future__ import annotations

from rlkit.analysis.runs import RunHistory, aggregate, from_rows, lower_is_better
from rlkit.analysis.study import START, every_arm, learner
from rlkit.sinks import flatten


def runs_by_arm(records: list, spec) -> tuple[dict, list[str]]:
    """{arm: {seed: RunHistory}} of every recorded run (with `baseline: start` also the starting
    policy's, `with_start`), and a line naming each that stopped before its last step (it diverged
    or crashed): such a run is counted by the study's `unfinished` rule in `per_run`, never dropped."""
    arms, unfinished = {}, []
    for head, rows in records:
        run = from_rows(
            f"{head['arm']} seed {head['seed']}", {**flatten(head["config"]), **head["choices"]}, rows, head["finished"]
        )
        arms.setdefault(head["arm"], {})[head["seed"]] = run
        if not head["finished"]:
            unfinished.append(f"{run.name}: stopped at step {run.last_step} (exit {head['exit']})")
    return with_start(spec, arms), unfinished


def starting_policy(run: RunHistory) -> RunHistory:
    """`run`'s starting policy as a run that never moved: each metric `run` logged at step 0, held at
    that value at every step `run` logged it (its gain is 0, its last and best are the start)."""
    held = {m: [(s, h[0][1]) for s, _ in h] for m, h in run.history.items() if h and h[0][0] == 0}
    return RunHistory(f"start of {run.name}", run.keys, held)


def with_start(spec, arms: dict) -> dict:
    """`arms`, with `baseline: start` also the starting-policy arm, one run per seed of `learner`'s."""
    if spec.baseline != START:
        return arms
    return {**arms, START: {s: starting_policy(r) for s, r in arms.get(learner(spec), {}).items()}}


def per_run(arms: dict, m, rule: str = "last") -> dict:
    """{arm: {seed: value}} of metric spec `m` (metric, aggregate, lower) over `runs_by_arm`'s runs.
    A run that stopped early counts by `rule`: `last`, its aggregate over what it logged (the
    arm's worst value when that is none); `worst`, the worst value of its arm's finished runs. A
    run without a value and an arm without any finished run's value are absent."""
    out = {}
    for arm, runs in arms.items():
        values = {s: aggregate(r, m.metric, m.aggregate, m.lower) for s, r in runs.items()}
        done = [v for s, v in values.items() if runs[s].finished and v is not None]
        worst = (max if lower_is_better(m.aggregate, m.lower) else min)(done) if done else None
        for s, r in runs.items():
            if not r.finished and (rule == "worst" or values[s] is None):
                values[s] = worst
        out[arm] = {s: v for s, v in values.items() if v is not None}
    return out


def pair(values: dict, base: str, arm: str) -> tuple[list[float], list[float]]:
    seeds = sorted(set(values.get(base, {})) & set(values.get(arm, {})))
    return [values[base][s] for s in seeds], [values[arm][s] for s in seeds]


def unpaired(values: dict, base: str, arm: str) -> list[str]:
    """A line for each seed one of the two arms has a value for and the other not (never ran, or
    no value): the pair cannot be formed, and the README says so."""
    a, b = set(values.get(base, {})), set(values.get(arm, {}))
    return [
        f"{arm} - {base}: seed {s} has no value in {base if s in b else arm}; its pair is missing"
        for s in sorted(a ^ b)
    ]


def planned_runs(spec, seeds: int) -> list[tuple[str, int]]:
    """Every arm and control at each of the first `seeds` seeds, seed by seed (pairs complete early)."""
    return [(arm, seed) for seed in range(seeds) for arm in every_arm(spec)]


def missing_runs(spec, records: list, plan) -> list[tuple[str, int]]:
    """The runs the study still owes: the planned seeds' (the pilot's while no plan is fixed; in a
    sequential design, every seed up to the last recorded one) not recorded."""
    recorded = {(head["arm"], head["seed"]) for head, _ in records}
    seeds = plan.seeds if plan else spec.seeds.pilot
    if spec.sequential:  # every look's seed complete, up to the last one begun
        seeds = max([seeds, *(head["seed"] + 1 for head, _ in records)])
    return [run for run in planned_runs(spec, seeds) if run not in recorded]
