"""A declared study's report: the declaration in words, and the `Analysis` of its records
(`rlkit.analysis.decision`) formatted, written below a marker in the study's README with a plot of
the primary metric. Nothing here computes a statistic."""

from __future__ import annotations

import math
from pathlib import Path

from rlkit import atomic
from rlkit.analysis.arms import missing_runs
from rlkit.analysis.budget import compute_words, exhausted, seed_hours
from rlkit.analysis.compare import plot
from rlkit.analysis.decision import analyse, fmt_ci, seeds_to_decide, settled
from rlkit.analysis.runs import aggregate_name
from rlkit.analysis.study import START, earliest_look, learner, learning_arm, learning_margin, treatments
from rlkit.analysis.values import Analysis, Bound, Plan

# the gates a sequential study's later looks can still pass (`decision.hopeless` says when they no longer can);
# a failed starting-policy or engagement check stays failed at every look
OPEN_GATES = ("Learning check", "Positive control", "Premises")
MARKER = "<!-- rlkit-study: everything below this line is written by rlkit-study; edits here are replaced -->"


def engagement_words(e) -> str:
    if e is None:
        return "none declared"
    bound = Bound.of(e)
    return f"{aggregate_name(e.aggregate)} {e.metric} {bound}" + (
        f" in the {e.arm} arm" if e.arm else " in each treatment arm"
    )


def seed_words(spec, plan: Plan | None) -> str:
    first = f"run seeds from {spec.seeds.first}; " if spec.seeds.first else ""
    return first + _seed_words(spec, plan)


def _seed_words(spec, plan: Plan | None) -> str:
    if spec.sequential:
        return (
            f"sequential: a look after every completed seed, the first at {spec.seeds.pilot} seeds, the last at "
            f"the cap of {spec.seeds.cap}, every test anytime-valid (confidence sequences, "
            f"prior {spec.sequential.prior:g}: no look before {earliest_look(spec)} seeds can reject); "
            "the study stops at the first look where a gate can no longer pass or every verdict is decided"
        )
    seeds = f"pilot {spec.seeds.pilot}, cap {spec.seeds.cap}"
    if plan is None:
        return seeds
    sds = "".join(f"; {a}: pilot sd {n.pilot_sd:.3g} raised to {n.planning_sd:.3g}" for a, n in plan.arms.items())
    gates = "".join(
        f"; {g}: needs {n.needed if n.needed is not None else 'more than any count (the pilot fell short)'}"
        for g, n in plan.gates.items()
    )
    to_cap = "; run to the cap by decision (--to-cap)" if plan.to_cap else ""
    afford = f"; the budget affords {plan.affordable} at the pilot's cost" if plan.affordable is not None else ""
    return seeds + f"; planned {plan.seeds} per arm (needed {plan.needed}{sds}{gates}{afford}){to_cap}"


def gate_words(spec) -> list[str]:
    """The positive control, the premises and the rule for runs that stopped early, in words."""
    S, delta = spec.sensitivity, spec.primary.smallest_effect
    lines = [
        f"- Positive control: `{S.arm}` must differ from the baseline {S.direction or spec.primary.direction} by "
        f">= {delta:g}, significantly; failing it, no verdict"
        if S
        else "- Positive control: none declared (so no equivalence is reported; other verdicts are not gated)"
    ]
    lines += [
        f"- Premise: {p.why or p.metric}: {p.arm or learner(spec)}'s {aggregate_name(p.aggregate)} {p.metric} "
        + str(Bound.of(p))
        for p in spec.premises
    ] or ["- Premises: none declared"]
    return lines + [f"- Runs that stop early count by: {spec.unfinished}"]


def protocol(spec, plan: Plan | None, treatments: int) -> list[str]:
    """The study file in words, with the plan fixed from the pilot."""
    P = spec.primary
    arms = ", ".join(f"`{a}` ({' '.join(o) or 'no overrides'})" for a, o in spec.arms.items())
    effect = (
        f"equal within ±{P.smallest_effect:g}"
        if P.direction == "equal"
        else f"{P.direction} by at least {P.smallest_effect:g}"
    )
    lines = [
        f"- Claim: {spec.claim.strip()} ({spec.source})",
        f"- Arms: {arms}; baseline `{spec.baseline}`"
        + (" (each seed's starting policy: its step-0 evaluation, held)" if spec.baseline == START else "")
        + f"; shared overrides: {' '.join(spec.config) or 'none'}",
        f"- Primary: {aggregate_name(P.aggregate)} of {P.metric} per run; each treatment {effect} against the "
        f"baseline; alpha {spec.alpha:g} for significance and for TOST at the smallest effect (each Holm across "
        f"{treatments} treatment(s)), power {spec.power:g}; outcomes: reproduced, negligible, equivalent, refuted, "
        "inconclusive",
        "- Secondary (Holm across every line): "
        + (", ".join(f"{aggregate_name(m.aggregate)} {m.metric}" for m in spec.secondary) or "none"),
        f"- Engagement: {engagement_words(spec.engagement)}",
    ]
    if spec.learning is not None:
        L = spec.learning
        lines.append(
            f"- Learning check: {'the baseline' if learning_arm(spec) == spec.baseline else learning_arm(spec)}'s "
            f"{aggregate_name(L.aggregate)} {L.metric} per run exceeds "
            f"{learning_margin(spec):g} "
            f"with its whole {1 - spec.alpha:.0%} interval; failing it, no verdict"
        )
    lines += gate_words(spec)
    if spec.controls:
        lines.append(
            "- Controls, beside the baseline on the learning metric: "
            + ", ".join(f"`{c}` ({' '.join(o)})" for c, o in spec.controls.items())
        )
    return lines + [f"- Seeds: {seed_words(spec, plan)}"]


def stop_lines(spec, records: list, r: Analysis) -> list[str]:
    """A sequential study's last look: why it stopped there, or that it is not settled."""
    if not spec.sequential:
        return []
    n = len({head["seed"] for head, _ in records})
    return [ended(spec, records, r) or f"Not settled at {n} seeds (cap {spec.seeds.cap}).", ""]


def ended(spec, records: list, r: Analysis) -> str | None:
    """Why a sequential study's runs are over, in a sentence: its last look settled it, its declared
    budget is spent, or it reached its cap; None while it goes on."""
    n, why = len({head["seed"] for head, _ in records}), settled(spec, r)
    if why:
        return f"Stopped at {n} seeds: {why}."
    spent = exhausted(spec, records)
    if spent:
        return f"Stopped at {n} seeds, undecided: {spent}.{undecided_cost(spec, records, r)}"
    if n >= spec.seeds.cap:
        return f"Stopped at the cap of {n} seeds, undecided.{undecided_cost(spec, records, r)}"
    return None


def undecided_cost(spec, records: list, r: Analysis) -> str:
    """What deciding each open treatment would cost: the seeds a fixed-sample test needs at the
    observed spread (a sequential one needs more), in run-hours at the recorded cost of a seed."""
    words = []
    for arm in r.treatments:
        n = seeds_to_decide(spec, r.diffs[arm]) if r.verdicts[arm].word == "inconclusive" else None
        if n:
            words.append(f"about {n} seeds per arm for {arm} ({n * seed_hours(records):.1f} run-hours in all)")
    if not words:
        return ""
    return " At the observed spread a fixed-sample test would need " + "; ".join(words) + " to decide."


def verdict_lines(spec, r: Analysis, looking: int | None = None) -> list[str]:
    """A verdict section per treatment: the word, the difference, the reason, the robust statistics;
    at a sequential study's open look (`looking`: its seeds so far) no word, since later looks decide."""
    lines = []
    for arm in r.treatments:
        v = r.verdicts[arm]
        word, why = (v.text, f"; {v.why}") if looking is None else (f"open (look at {looking} seeds)", "")
        lines += [
            f"### Verdict, {arm} against {spec.baseline}: {word}",
            "",
            f"{arm} - {spec.baseline}: {r.diffs[arm].describe()}{why}.",
            "",
        ]
        rob = r.robust[arm]
        if rob is not None:
            lines += [rob.describe(spec.baseline, arm, spec.primary.lower), ""]
    return lines


def secondary_lines(spec, r: Analysis) -> list[str]:
    if not r.secondary:
        return []
    n = len(r.secondary)
    lines = [f"### Secondary ({n} line{'s' if n > 1 else ''}, Holm-adjusted p beside each)", ""]
    for row, p_adj in zip(r.secondary, r.secondary_holm):
        if row.diff is None:
            lines.append(f"- {row.label}: not computed: {row.withdrawn}")
            continue
        extra = "" if math.isnan(p_adj) else f"; Holm-adjusted p = {p_adj:.2g}"
        rob = f"; {row.robust.describe(spec.baseline, row.arm, row.lower)}" if row.robust else ""
        lines.append(f"- {row.label}: {row.diff.describe()}{extra}{rob}")
    return lines + [""]


def provenance_lines(spec, records: list, name: str) -> list[str]:
    """How many runs, on which CPUs, their run-hours, and the command that recomputes every number."""
    hw = [h.get("hardware") or {} for h, _ in records]
    cpus = sorted(
        {
            f"{x.get('cpu', '?')} (torch kernels {x.get('cpu_capability', '?')}, pins {x.get('pins') or 'none'})"
            for x in hw
        }
    )
    return [
        "### Where the numbers come from",
        "",
        f"{len(records)} runs, raw metrics in `results/runs/` (one gzipped JSON-lines file per run), on "
        f"{'; '.join(cpus)}; compute: {compute_words(spec, records)}. Every number above: "
        f"`rlkit-study {name} --analyse-only`.",
        "",
    ]


def incomplete_lines(name: str, records: list, plan: Plan | None, missing: list) -> list[str]:
    """What a study with planned runs still to come reports instead of its comparisons, so that no
    interim look can steer it (its seeds are fixed by the plan)."""
    owed = ", ".join(f"{arm} seed {seed}" for arm, seed in missing)
    stage = "planned" if plan else "pilot"
    return [
        f"Incomplete: {len(records)} of {len(records) + len(missing)} {stage} runs recorded (to come: {owed}).",
        f"The verdict and every comparison are withheld until the last is in; `rlkit-study {name} --jobs 2`",
        "resumes the study.",
        "",
    ]


def report(spec, name: str, results: Path, records: list, plan: Plan | None) -> str:
    """The README section: the declared protocol, the plan, the result table, verdicts, secondary
    lines, what was left out and where the numbers come from; only the protocol and what is missing
    while planned runs are still to come."""
    lines = [MARKER, "", "## Declared protocol (study.yaml)", "", *protocol(spec, plan, len(treatments(spec))), ""]
    lines += ["## Result", ""]
    missing = missing_runs(spec, records, plan)
    if missing:
        return "\n".join(lines + incomplete_lines(name, records, plan, missing))
    r, P = analyse(spec, records, plan), spec.primary
    lines += [f"| arm | runs | {aggregate_name(P.aggregate)} {P.metric} |", "|---|---|---|"]
    for arm in [*spec.arms, *spec.controls]:
        v = list(r.values.get(arm, {}).values())
        lines.append(f"| {arm} | {len(v)} | {fmt_ci(v)} |")
    lines.append("")
    looking = len({h["seed"] for h, _ in records}) if spec.sequential and not ended(spec, records, r) else None
    lines += stop_lines(spec, records, r) + verdict_lines(spec, r, looking)
    sections = [
        ("Starting policy", r.gates["start"].lines),
        ("Learning check", r.gates["learning"].lines),
        ("Positive control", r.gates["sensitivity"].lines),
        ("Premises", r.gates["premises"].lines),
        ("Engagement", r.engagement_lines),
    ]
    for title, shown in sections:
        if looking is not None and title in OPEN_GATES:  # not failed while a later look can still pass it
            shown = [x.split(": FAILED")[0] + ": not passed yet" if ": FAILED" in x else x for x in shown]
        if shown or title in ("Positive control", "Premises", "Engagement"):
            lines += [f"### {title}", "", *[f"- {x}" for x in shown], ""]
    lines += secondary_lines(spec, r)
    if r.unfinished:
        rule = {"last": "its aggregate over what it logged", "worst": "its arm's worst value"}[spec.unfinished]
        lines += ["### Runs that stopped early (counted, as declared, by " + rule + ")", ""]
        lines += [*[f"- {x}" for x in r.unfinished], ""]
    if r.unpaired:
        lines += ["### Seeds without a pair", "", *[f"- {x}" for x in r.unpaired], ""]
    lines += provenance_lines(spec, records, name)
    if plot_primary(spec, r.arms, results):
        lines += [f"![{P.metric}](results/{P.metric.replace('/', '_')}.png)", ""]
    return "\n".join(lines)


def plot_primary(spec, arms: dict, results: Path) -> bool:
    groups = {(arm,): list(arms[arm].values()) for arm in [*spec.arms, *spec.controls] if arms.get(arm)}
    png = results / (spec.primary.metric.replace("/", "_") + ".png")
    return bool(groups) and plot(groups, ["arm"], spec.primary.metric, png)


def write_report(spec, name: str, path: Path, results: Path, records: list, plan: Plan | None) -> str:
    """The report, written into README.md beside the study file below MARKER (text above it is kept)."""
    section = report(spec, name, results, records, plan)
    readme = path.parent / "README.md"
    head = readme.read_text().split(MARKER)[0].rstrip() if readme.exists() else f"# Study: {name}"
    atomic.write_text(readme, head + "\n\n" + section)
    return section
