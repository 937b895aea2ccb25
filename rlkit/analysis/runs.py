"""Runs as the analysis sees them: loaded from run directories (or wandb), checked, and reduced to
one number each (a per-run aggregate) for rlkit-compare and rlkit-study. Nothing is dropped or
changed without a warning that says what was used instead."""

from __future__ import annotations

import functools
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# config keys that may differ between the runs of one arm without making them different runs
INCIDENTAL = ("seed", "warm_start.cache_dir", "threads", "logger", "hydra", "run_dir")


@dataclass
class RunHistory:
    name: str
    keys: dict  # chosen options and flattened config
    history: dict = field(default_factory=dict)  # metric -> list of (step, value), finite values only
    wall_s: float | None = None
    finished: bool = True  # summary.json written (the run reached its last step)
    nonfinite: dict = field(default_factory=dict)  # metric -> steps where it was logged as nan or inf
    warned: set = field(default_factory=set)  # metrics whose non-finite steps were already named
    job: int | None = None  # its number in a Hydra sweep

    @property
    def last_step(self) -> int:
        return max((s for series in self.history.values() for s, _ in series), default=0)


WARNINGS: list[str] = []  # this command's warnings, for its report as well as stderr


def warn(message: str) -> None:
    WARNINGS.append(message)
    print(f"rlkit: warning: {message}", file=sys.stderr)


def number(v) -> float | None:
    """A logged value as a float: numbers, and the strings JSON-lines logs write for nan and inf."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(v)
    return None


def from_rows(
    name: str, keys: dict, rows: list[dict], finished: bool = True, wall_s: float | None = None
) -> RunHistory:
    """A run from its metrics records (one dict per step, later records for a step replacing earlier)."""
    run = RunHistory(name, keys, finished=finished)
    by_step = {row["step"]: row for row in rows}
    for step in sorted(by_step):
        for k, v in by_step[step].items():
            x = number(v)
            if k == "step" or x is None:
                continue
            if math.isfinite(x):
                run.history.setdefault(k, []).append((step, x))
            else:
                run.nonfinite.setdefault(k, []).append(step)
    run.wall_s = wall_s if wall_s is not None else sum(v for _, v in run.history.get("time/step", []))
    return run


def load_run(d: Path, name: str) -> RunHistory:
    """The run in directory `d`; a `run.json` that is not rlkit's raises ValueError naming the file,
    and metrics records that are not objects with an integer step are left out, and said."""
    from rlkit.sinks import flatten, read_jsonl

    meta = json.loads((d / "run.json").read_text())
    if not (isinstance(meta, dict) and isinstance(meta.get("config"), dict) and isinstance(meta.get("choices"), dict)):
        raise ValueError("not a run record of rlkit's (an object with 'config' and 'choices')")
    records = read_jsonl(d / "metrics.jsonl")
    rows = [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)]
    if len(rows) < len(records):
        bad = next(r for r in records if r not in rows)
        warn(
            f"{d / 'metrics.jsonl'} has {len(records) - len(rows)} records that are not objects with an integer "
            f"step (the first: {json.dumps(bad)[:80]}); left out"
        )
    repeated = sorted(s for s, n in Counter(r["step"] for r in rows).items() if n > 1)
    if repeated:
        warn(
            f"{d / 'metrics.jsonl'} has step {repeated[0]} more than once (two runs in one directory?); keeping "
            "the last"
        )
    run = from_rows(
        name, {**flatten(meta["config"]), **meta["choices"]}, rows, (d / "summary.json").exists(), wall_of(d)
    )
    run.job = meta.get("job")
    return run


def wall_of(d: Path) -> float | None:
    """The run's wall seconds from its summary.json; None without one, or (said) when it cannot be
    read, and then the sum of its logged step times stands in."""
    summary = d / "summary.json"
    if not summary.exists():
        return None
    try:
        wall = json.loads(summary.read_text()).get("wall_s")
        return float(wall) if isinstance(wall, (int, float)) else None
    except (OSError, ValueError, AttributeError) as e:
        warn(f"{summary} cannot be read ({type(e).__name__}: {e}); the run's wall time is its logged step times")
        return None


def load_runs(root: Path) -> list[RunHistory]:
    """Every directory under `root` holding run.json and metrics.jsonl; one that cannot be read is
    named and left out. Under a sweep's folder, its failed and missing jobs are named too."""
    runs = []
    for info in sorted(root.rglob("run.json")):
        if not (info.parent / "metrics.jsonl").exists():
            continue
        try:
            runs.append(load_run(info.parent, str(info.parent.relative_to(root)) if info.parent != root else root.name))
        except (OSError, ValueError, AttributeError) as e:
            warn(f"{info} cannot be read ({type(e).__name__}: {e}); its run is left out")
    report_sweep(root, runs)
    return runs


def report_sweep(root: Path, runs: list[RunHistory]) -> None:
    """Name each job of the sweep in `root` that failed (its exit code and last error line) and each
    that left no run record (never started, killed before its first evaluation, or removed)."""
    from rlkit import sweeps

    failed = sweeps.failures(root)
    for folder, record in failed:
        warn(
            f"job {record.get('job')} ({folder}) failed with exit code {record.get('exit_code')}: {record.get('error')}"
        )
    jobs = sweeps.jobs(root)
    if jobs is None:
        return
    seen = {r.job for r in runs} | {record.get("job") for _, record in failed}
    for num, overrides in enumerate(jobs):
        if num not in seen:
            warn(f"job {num} of the sweep ({' '.join(overrides)}) left no run record: it never ran, or was removed")


def load_wandb_runs(project: str) -> list[RunHistory]:
    """Runs of a wandb project ("entity/project") through wandb's public API (needs a server)."""
    import wandb

    runs = []
    for r in wandb.Api().runs(project):
        rows = [
            {"step": row["_step"], **{k: v for k, v in row.items() if not k.startswith("_")}}
            for row in r.scan_history()
        ]
        runs.append(from_rows(r.name, dict(r.config), rows, r.state == "finished", r.summary.get("_runtime")))
    return runs


def finished_only(runs: list[RunHistory], include_unfinished: bool = False) -> list[RunHistory]:
    """The runs that reached their last step; the others are named and left out (or kept, and said)."""
    for r in runs:
        if not r.finished:
            planned = r.keys.get("steps", "?")
            warn(
                f"run {r.name} stopped at step {r.last_step} of {planned} (no summary.json); "
                + (
                    "kept, as --include-unfinished asks"
                    if include_unfinished
                    else "left out (--include-unfinished keeps it)"
                )
            )
    return runs if include_unfinished else [r for r in runs if r.finished]


def differing_keys(runs: list[RunHistory], by: list[str]) -> dict:
    """Config keys (other than `by`, seeds and paths) whose values differ between the runs of one arm."""
    keys = {k for r in runs for k in r.keys if k not in by and not k.startswith(INCIDENTAL)}
    out = {}
    for k in sorted(keys):
        values = {json.dumps(r.keys.get(k), sort_keys=True, default=str) for r in runs}
        if len(values) > 1:
            out[k] = sorted(values)
    return out


def x_of(run: RunHistory, axis: str) -> dict:
    """Step -> horizontal position: the step, generated tokens so far, or wall seconds so far."""
    steps = sorted({s for series in run.history.values() for s, _ in series})
    if axis == "step":
        return {s: float(s) for s in steps}
    per_step = dict(run.history.get({"tokens": "train/gen_tokens", "time": "time/step"}[axis], []))
    total, out = 0.0, {}
    for s in steps:
        total += per_step.get(s, 0.0)
        out[s] = total
    return out


# ---- per-run aggregates: one number per run ------------------------------------------------------------------------


class Withdrawn(ValueError):
    """An aggregate rlkit once computed wrongly: refused, never silently redefined (a study declared
    with it shows the line as withdrawn)."""


WITHDRAWN = {
    "auc:tokens": "it divided each run's area by that run's own token span, so a run that spent three times the "
    "tokens on the same accuracy curve scored the same: it never compared runs at equal generated tokens; "
    "auc:tokens:B does (the mean height over the first B generated tokens)",
}


@functools.lru_cache(maxsize=None)  # each spelling parsed once
def parse_aggregate(spec: str) -> tuple[str, int | str | tuple]:
    """'final', 'last:K' (mean of the last K logged values), 'auc' (mean height of the curve over
    steps), 'auc:tokens:B' (mean height over the first B generated tokens, the same token range
    for every run; a run that generated fewer has no value), 'best' (best value after step 0),
    'gain' / 'gain:K' (the last value, or the mean of the last K, minus the step-0 value: what
    training changed), 'start' (the step-0 value: the starting policy's) or 'reach:X' /
    'reach:X:tokens' / 'reach:X:time' (the steps, generated tokens or seconds until the metric
    first reaches X; a run that never does counts at its end, censored).
    -> (kind, K, the auc's axis and token budget (axis, B) or the target (X, axis))"""
    if spec in WITHDRAWN:
        raise Withdrawn(f"aggregate {spec!r} is withdrawn: {WITHDRAWN[spec]}")
    kind, _, k = spec.partition(":")
    if kind in ("last", "gain") and k.isdigit() and int(k) >= 1:
        return kind, int(k)
    if kind == "auc" and k in ("", "step"):
        return "auc", ("step", None)
    if kind == "auc" and k.startswith("tokens:"):
        budget = k.removeprefix("tokens:")
        if budget.isdigit() and int(budget) >= 1:
            return "auc", ("tokens", int(budget))
    if kind in ("final", "best", "gain", "start") and not k:
        return kind, 1
    if kind == "reach":
        value, _, axis = k.partition(":")
        try:
            if axis in ("", "step", "tokens", "time") and math.isfinite(float(value)):
                return "reach", (float(value), axis or "step")
        except ValueError:
            pass
    raise ValueError(
        f"aggregate {spec!r}: use final, last:K (K >= 1), auc, auc:tokens:B (B >= 1 generated tokens), best, gain, "
        "gain:K, start or reach:X[:tokens|:time] (X a finite number)"
    )


def aggregate_name(spec: str) -> str:
    if spec in WITHDRAWN:
        return f"{spec} (withdrawn)"
    kind, k = parse_aggregate(spec)
    if kind == "reach":
        unit = {"step": "steps", "tokens": "generated tokens", "time": "seconds"}[k[1]]
        return f"{unit} to reach {k[0]:g}"
    if kind == "auc":
        return "area (mean over steps)" if k[1] is None else f"area (mean over the first {k[1]} generated tokens)"
    return {
        "final": "final",
        "last": f"mean of last {k}",
        "best": "best after step 0",
        "gain": "final minus step 0" if k == 1 else f"mean of last {k} minus step 0",
        "start": "step-0 value",
    }[kind]


def lower_is_better(spec: str, lower: bool) -> bool:
    """Whether a smaller per-run aggregate is the better one: a cost to reach a target always is."""
    return parse_aggregate(spec)[0] == "reach" or lower


def reached(run: RunHistory, metric: str, spec: str, lower: bool = False) -> bool:
    """Whether `run` reached the target of a `reach:X` aggregate (False: its cost is censored)."""
    kind, k = parse_aggregate(spec)
    return kind != "reach" or any((v <= k[0] if lower else v >= k[0]) for _, v in run.history.get(metric, []))


def aggregate(run: RunHistory, metric: str, spec: str, lower: bool = False) -> float | None:
    """`run`'s one number for `metric` under `spec`; None when it logged no value to reduce (and
    a warning when values it logged as nan or inf were left out)."""
    kind, k = parse_aggregate(spec)
    series = run.history.get(metric, [])
    if run.nonfinite.get(metric) and metric not in run.warned:  # named once, at its first use
        run.warned.add(metric)
        warn(
            f"run {run.name} logged {metric} as nan or inf at steps {run.nonfinite[metric]}; those steps are "
            f"left out of its {aggregate_name(spec)}"
            + (f" (its last finite value is from step {series[-1][0]})" if series else "")
        )
    if kind == "best":
        series = [(s, v) for s, v in series if s > 0]  # the step-0 evaluation is the shared start, not a result
    if not series:
        return None
    if kind == "start":
        return series[0][1] if series[0][0] == 0 else None
    if kind == "reach":  # the cost until the first value at the target; a run that never got there, its end
        target, axis = k
        first = next((s for s, v in series if (v <= target if lower else v >= target)), None)
        at = x_of(run, axis)  # step -> cost so far
        return at.get(first if first is not None else max(at), float("nan"))
    values = [v for _, v in series]
    if kind == "gain":  # the last K values after step 0, less the step-0 value
        after = values[1:][-k:]
        return sum(after) / len(after) - values[0] if series[0][0] == 0 and after else None
    if kind in ("final", "last"):
        return sum(values[-k:]) / len(values[-k:])
    if kind == "best":
        return min(values) if lower else max(values)
    axis, budget = k
    at = x_of(run, axis)  # step -> position on the axis
    xs = [at.get(s, float(s)) for s, _ in series]
    if budget is not None:
        return area_to(xs, values, budget)
    if len(series) == 1:
        return values[0]
    area = sum((x1 - x0) * (v0 + v1) / 2 for x0, x1, v0, v1 in zip(xs, xs[1:], values, values[1:]))  # trapezoids
    return area / (xs[-1] - xs[0]) if xs[-1] > xs[0] else values[-1]


def area_to(xs: list[float], values: list[float], budget: float) -> float | None:
    """Mean height of the curve through (xs, values) from its first point to `budget` on its axis
    (linear between points); None when the curve ends before `budget` (the run did not get there)."""
    if xs[-1] < budget or xs[0] >= budget:
        return None
    area = 0.0
    for x0, x1, v0, v1 in zip(xs, xs[1:], values, values[1:]):
        if x0 >= budget:
            break
        end = min(x1, budget)
        v_end = v0 + (v1 - v0) * (end - x0) / (x1 - x0) if x1 > x0 else v1
        area += (end - x0) * (v0 + v_end) / 2  # a trapezoid, cut at the budget
    return area / (budget - xs[0])
