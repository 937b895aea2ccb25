"""What a study keeps: one gzipped JSON-lines file per finished run (its head: arm, seed,
overrides, the declaration, config and hardware; then its metric rows), the plan fixed from the
pilot, and the checks that the study file still says what the runs were made under."""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path

from rlkit import atomic
from rlkit.analysis import stats
from rlkit.analysis.arms import pair, per_run, runs_by_arm
from rlkit.analysis.budget import affordable
from rlkit.analysis.runs import wall_of
from rlkit.analysis.study import (
    Stopped,
    StudySpec,
    changes,
    declared,
    every_arm,
    extensible,
    learner,
    learning_arm,
    learning_margin,
    overrides,
    treatments,
    with_defaults,
)
from rlkit.analysis.values import Need, Plan
from rlkit.exits import EXIT_BAD_INPUT


def record_path(results: Path, arm: str, seed: int) -> Path:
    return results / "runs" / f"{arm}_seed{seed}.jsonl.gz"


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
        "wall_s": wall_of(run_dir),  # None for a run without a summary: its logged times stand in
    }
    path = record_path(results, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.staged(path, path.name) as tmp:
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


def read_plan(path: Path) -> Plan:
    """The plan fixed from the pilot; a damaged file is named with what to do."""
    try:
        kept = json.loads(path.read_text())
        if not isinstance(kept, dict):
            raise ValueError("not a plan")
        return Plan.from_json(kept)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Stopped(
            EXIT_BAD_INPUT,
            f"{path} is damaged ({type(e).__name__}: {e}): restore it from version "
            "control, or delete it and rerun `rlkit-study` without --analyse-only, which fixes the plan "
            "again from the pilot's records (the same plan)",
        ) from None


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
    plan_file, now = results / "plan.json", extensible(declared(spec))
    kept = [(str(plan_file), read_plan(plan_file).declared)] if plan_file.exists() else []
    kept += [(f"the record of {h['arm']} seed {h['seed']}", h["declared"]) for h, _ in records if "declared" in h]
    for where, was in kept:
        was = extensible(with_defaults(was))
        if was != now:
            raise Stopped(
                EXIT_BAD_INPUT,
                f"{name}: the study file differs from the declaration in {where}, under "
                f"which the runs were made: {'; '.join(changes(was, now))}; {fix}",
            )


def check_logged(spec: StudySpec, records: list) -> None:
    """Every declared metric was logged by the pilot's runs (the engagement metric by a treatment
    arm's, a premise's by its arm's), so a misspelled name stops the study before it spends the
    rest of its seeds."""
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
    missing += [p.metric for p in spec.premises if p.metric not in logged.get(p.arm or learner(spec), ())]
    if missing:
        raise Stopped(
            EXIT_BAD_INPUT,
            f"no pilot run logged {', '.join(missing)}; logged: {', '.join(sorted(everywhere - {'step'}))[:1500]}",
        )


def plan(spec: StudySpec, records: list) -> Plan:
    """Seeds per arm from the pilot's paired spread, inflated to its upper confidence limit, at the
    declared smallest effect (an equivalence margin for `equal`), Bonferroni over the treatments;
    and for each gate that needs power (`gate_plans`: the positive control, the learning check) the
    seeds it needs. The most any of them needs is the plan, up to the cap (or the seeds the declared budget
    pays for at the pilot's cost of a seed, where fewer)."""
    pilot = [(head, rows) for head, rows in records if head["seed"] < spec.seeds.pilot]  # a replan gives the same plan
    arms = runs_by_arm(pilot, spec)[0]
    values = per_run(arms, spec.primary, spec.unfinished)
    tested = treatments(spec)
    alpha, needs = spec.alpha / len(tested), {}
    for arm in tested:
        d = stats.paired(*pair(values, spec.baseline, arm))  # a treatment whose pilot left no value: no pairs
        sd = raised(d, spec.seeds.pilot_confidence)
        if spec.primary.direction == "equal":
            need = stats.seeds_for_equivalence(spec.primary.smallest_effect, sd, spec.power, alpha)
        else:
            need = stats.seeds_for_power(spec.primary.smallest_effect, sd, True, spec.power, alpha)
        needs[arm] = Need(d.sd, sd, need if need is not None else spec.seeds.pilot, pilot_pairs=d.n)
    gates = gate_plans(spec, arms, values)
    needed = max([n.needed for n in needs.values()] + [g.needed or 0 for g in gates.values()])
    afford = affordable(spec, pilot)
    limit = min(spec.seeds.cap, afford or spec.seeds.cap)
    return Plan(
        pilot_seeds=spec.seeds.pilot,
        cap=spec.seeds.cap,
        alpha_for_planning=alpha,
        arms=needs,
        declared=declared(spec),
        needed=needed,
        seeds=min(limit, max(spec.seeds.pilot, needed)),
        capped=needed > limit,
        gates=gates,
        short=tuple(g for g, n in gates.items() if n.needed is None),
        affordable=afford,
    )


def gate_plans(spec: StudySpec, arms: dict, values: dict) -> dict[str, Need]:
    """{gate: the pilot's effect, its sd raised as the primary's is, seeds needed} for the gates that
    need power, taking the pilot's effect as the true one (a gate is no claim: its strength is the
    testbed's): the positive control, whose paired difference from the baseline must be significant
    and at least the smallest effect, and the learning check, whose gains' interval must clear the
    margin. `needed` is None when the pilot fell short of the gate's bound (the control moved less
    than the smallest effect, or the mean gain stayed under the margin): more seeds would
    foreseeably not pass it."""
    out, power, alpha, conf = {}, spec.power, spec.alpha, spec.seeds.pilot_confidence
    if spec.sensitivity is not None:
        S = spec.sensitivity
        sign = 1 if (S.direction or spec.primary.direction) == "higher" else -1
        d = stats.paired(*pair(values, spec.baseline, S.arm))
        sd = raised(d, conf)
        effect, delta = sign * d.diff, spec.primary.smallest_effect
        need = None
        if effect > delta:  # significant against 0, and the mean past the smallest effect, each with `power`
            need = max(stats.seeds_for_power(effect, sd, True, power, alpha) or 2, beyond(effect - delta, sd, power))
        out["positive control"] = Need(d.sd, sd, need, pilot_effect=effect)
    if spec.learning is not None:
        gains = list(per_run(arms, spec.learning, spec.unfinished).get(learning_arm(spec), {}).values())
        d = stats.paired([0.0] * len(gains), gains)
        sd, excess = raised(d, conf), d.diff - learning_margin(spec)
        # the interval's lower end past the margin: a one-sided test of the excess at alpha / 2
        need = (stats.seeds_for_power(excess, sd, True, power, alpha) or 2) if excess > 0 else None
        out["learning check"] = Need(d.sd, sd, need, pilot_effect=d.diff)
    return out


def raised(d: stats.Difference, confidence: float) -> float:
    """The pilot's sd raised to its upper confidence limit (nan below two pairs)."""
    return stats.inflated_sd(d.sd, d.n, confidence) if d.n >= 2 else float("nan")


def beyond(excess: float, sd: float, power: float) -> int:
    """Pairs at which a mean whose true value lies `excess` past a bound lands past it with `power`."""
    return 2 if not sd > 0 else max(2, math.ceil((stats.sps.norm.ppf(power) * sd / excess) ** 2))
