"""A declared study's analysis, exactly as its study file says: each run reduced to its declared
aggregate, treatments paired with the baseline by seed, the primary test (Holm across treatments),
the engagement check, secondary lines (Holm across all of them), and the verdict in words,
written below a marker in the study's README with a plot of the primary metric."""

from __future__ import annotations

import math
from pathlib import Path

from rlkit import atomic
from rlkit.analysis import stats
from rlkit.analysis.compare import fmt, plot
from rlkit.analysis.runs import aggregate, aggregate_name, from_rows
from rlkit.analysis.stats import mean_ci
from rlkit.sinks import flatten

MARKER = "<!-- rlkit-study: everything below this line is written by rlkit-study; edits here are replaced -->"


def runs_by_arm(records: list) -> tuple[dict, list[str]]:
    """{arm: {seed: RunHistory}} of the runs that reached their last step, and a line for each one left out."""
    arms, left_out = {}, []
    for head, rows in records:
        run = from_rows(
            f"{head['arm']} seed {head['seed']}", {**flatten(head["config"]), **head["choices"]}, rows, head["finished"]
        )
        if head["finished"]:
            arms.setdefault(head["arm"], {})[head["seed"]] = run
        else:
            left_out.append(f"{run.name}: stopped at step {run.last_step} (exit {head['exit']}); not analysed")
    return arms, left_out


def per_run(arms: dict, m) -> dict:
    """{arm: {seed: value}} of metric spec `m` (metric, aggregate, lower) over `runs_by_arm`'s runs;
    runs without a value are absent."""
    return {
        arm: {s: v for s, r in runs.items() if (v := aggregate(r, m.metric, m.aggregate, m.lower)) is not None}
        for arm, runs in arms.items()
    }


def pair(values: dict, base: str, arm: str) -> tuple[list[float], list[float]]:
    seeds = sorted(set(values.get(base, {})) & set(values.get(arm, {})))
    return [values[base][s] for s in seeds], [values[arm][s] for s in seeds]


def decide(
    spec, d: stats.Difference, p_adj: float, engaged: bool | None, capped: bool, learned: bool | None = None
) -> tuple[str, str]:
    """The verdict and its reason for one treatment's primary difference d (treatment - baseline)."""
    if learned is False:
        return (
            "not tested",
            "the baseline did not learn (the learning check failed), so the testbed cannot show the claim",
        )
    if engaged is False:
        return "not tested", "the engagement check failed: the treatment did not act enough to test the claim"
    if d.n < 2:
        return "inconclusive", f"only {d.n} paired runs"
    judge = judge_equality if spec.primary.direction == "equal" else judge_direction
    verdict, need = judge(spec, d, p_adj)
    if verdict is not None:
        return verdict
    cost = f"; about {need} seeds per arm would decide it at the observed spread" if need else ""
    return "inconclusive", (
        f"undecided at the seed cap ({spec.seeds.cap})" if capped else f"undecided at the planned {d.n} seeds"
    ) + cost


def bounds(d: stats.Difference) -> tuple[float, float]:
    """The difference's interval (the difference itself when every pair differs by the same)."""
    return (d.diff, d.diff) if d.zero_variance else d.interval


def judge_equality(spec, d: stats.Difference, p_adj: float) -> tuple[tuple[str, str] | None, int | None]:
    """A claimed equality: equivalent or refuted with the reason, else None and the seeds per arm
    that would decide it."""
    delta, alpha = spec.primary.smallest_effect, spec.alpha
    lo, hi = bounds(d)
    if p_adj < alpha:
        return (
            "equivalent",
            f"the difference lies within ±{delta:g} (TOST adjusted p = {p_adj:.2g}): the claim holds",
        ), None
    if lo > delta or hi < -delta:
        return ("refuted", f"the interval [{lo:+.3f}, {hi:+.3f}] lies outside ±{delta:g}"), None
    return None, stats.seeds_for_equivalence(delta, d.sd, spec.power, alpha)


def judge_direction(spec, d: stats.Difference, p_adj: float) -> tuple[tuple[str, str] | None, int | None]:
    """A claimed direction (higher or lower): reproduced (a significant difference that way; the
    reason says when it is smaller than the declared smallest effect), equivalent (no effect as
    large as the smallest either way) or refuted with the reason, else None and the seeds per arm
    that would decide it."""
    delta, direction, alpha = spec.primary.smallest_effect, spec.primary.direction, spec.alpha
    lo, hi = bounds(d)
    sign = 1 if direction == "higher" else -1
    if sign * d.diff > 0 and (p_adj < alpha or d.zero_variance):
        how = "in every pair" if d.zero_variance else f"adjusted p = {p_adj:.2g}"
        small = f", but smaller than the declared smallest effect of {delta:g}" if sign * d.diff < delta else ""
        return ("reproduced", f"the difference is {direction} than 0 ({how}){small}"), None
    tost = d.tost(delta)
    if tost < alpha:
        return (
            "equivalent",
            f"no effect as large as {delta:g} either way (TOST p = {tost:.2g}): the claim fails here",
        ), None
    if max(sign * lo, sign * hi) < delta:  # the interval's far end in the claimed direction
        return (
            "refuted",
            f"the interval [{lo:+.3f}, {hi:+.3f}] excludes the claimed effect of {delta:g} {direction}",
        ), None
    return None, stats.seeds_for_power(delta, d.sd, True, spec.power, alpha)


def engagement(spec, arms: dict, treatments: list[str]) -> tuple[dict, list[str]]:
    """{treatment: passed} and a line per checked arm (each treatment, or the one declared arm,
    whose result then holds for every treatment); {} when the study declares no check."""
    e = spec.engagement
    if e is None:
        return {}, ["no engagement check declared"]
    values, passed, lines = per_run(arms, e), {}, []
    for arm in [e.arm] if e.arm else treatments:
        v = list(values.get(arm, {}).values())
        mean = sum(v) / len(v) if v else float("nan")
        passed[arm] = (mean >= e.at_least) if e.at_least is not None else (mean <= e.at_most)
        bound = f">= {e.at_least:g}" if e.at_least is not None else f"<= {e.at_most:g}"
        lines.append(
            f"{arm}: {aggregate_name(e.aggregate)} {e.metric} = {mean:.4g} over {len(v)} runs, needs {bound}: "
            + ("passed" if passed[arm] else "FAILED")
        )
    return {arm: passed[e.arm or arm] for arm in treatments}, lines


def learning(spec, arms: dict) -> tuple[bool | None, list[str]]:
    """Whether the baseline learned (its mean learning aggregate above 0 with its interval), and a
    line for it and for each control arm against it; (None, []) when the study declares no check."""
    L = spec.learning
    if L is None:
        return None, []
    values, name = per_run(arms, L), f"{aggregate_name(L.aggregate)} {L.metric}"
    gains = list(values.get(spec.baseline, {}).values())
    d = stats.paired([0.0] * len(gains), gains, spec.alpha)
    learned = d.n >= 2 and (d.diff > 0 if d.zero_variance else d.interval[0] > 0)
    lines = [
        f"{spec.baseline} (baseline): {name} = {d.describe()}: "
        + ("passed" if learned else "FAILED, the baseline did not learn")
    ]
    for control in spec.controls:
        own = list(values.get(control, {}).values())
        lines.append(
            f"{control} (control): {name} = {fmt_ci(own)} over {len(own)} runs; {spec.baseline} - {control}: "
            f"{stats.paired(*reversed(pair(values, spec.baseline, control)), spec.alpha).describe()}"
        )
    return learned, lines


def analyse(spec, records: list, plan: dict | None, robust: bool = True) -> dict:
    """Every number of the report, from the records alone; `robust` False leaves out the secondary
    lines' bootstrap statistics (the slow part), for a summary that needs only the verdicts."""
    treatments = [a for a in spec.arms if a != spec.baseline]
    arms, left_out = runs_by_arm(records)
    values = per_run(arms, spec.primary)
    diffs = {arm: stats.paired(*pair(values, spec.baseline, arm), alpha=spec.alpha) for arm in treatments}
    equal = spec.primary.direction == "equal"  # two-sided p for a claimed direction, TOST's p for a claimed equality
    raw = [d.tost(spec.primary.smallest_effect) if equal else d.p for d in diffs.values()]
    adjusted = stats.holm(raw)
    engaged, engagement_lines = engagement(spec, arms, treatments)
    learned, learning_lines = learning(spec, arms)
    capped = bool(plan and plan.get("capped"))
    verdicts = {
        arm: decide(spec, diffs[arm], p, engaged.get(arm), capped, learned) for arm, p in zip(treatments, adjusted)
    }
    secondary = secondary_differences(spec, arms, treatments, robust)
    return {
        "treatments": treatments,
        "values": values,
        "diffs": diffs,
        "p_raw": dict(zip(treatments, raw)),
        "p_adjusted": dict(zip(treatments, adjusted)),
        "verdicts": verdicts,
        "engagement": engagement_lines,
        "learned": learned,
        "learning": learning_lines,
        "secondary": secondary,
        "secondary_holm": stats.holm([d.p for _, d, *_ in secondary]),
        "left_out": left_out,
        "arms": arms,
    }


def secondary_differences(spec, arms: dict, treatments: list[str], robust: bool) -> list[tuple]:
    """Each secondary metric's paired difference (and, when `robust`, its bootstrap statistics) for
    every treatment: (label, difference, robust or None, arm, lower is better)."""
    lines = []
    for m in spec.secondary:
        vals = per_run(arms, m)
        for arm in treatments:
            a, b = pair(vals, spec.baseline, arm)
            label = f"{aggregate_name(m.aggregate)} {m.metric}: {arm} - {spec.baseline}"
            lines.append(
                (
                    label,
                    stats.paired(a, b, spec.alpha),
                    stats.robust(a, b, m.lower, spec.alpha) if robust else None,
                    arm,
                    m.lower,
                )
            )
    return lines


def fmt_ci(values: list[float]) -> str:
    return fmt(*mean_ci(values)) if values else "n/a"


def engagement_words(e) -> str:
    if e is None:
        return "none declared"
    bound = f">= {e.at_least:g}" if e.at_least is not None else f"<= {e.at_most:g}"
    return f"{aggregate_name(e.aggregate)} {e.metric} {bound}" + (
        f" in the {e.arm} arm" if e.arm else " in each treatment arm"
    )


def seed_words(spec, plan: dict | None) -> str:
    seeds = f"pilot {spec.seeds.pilot}, cap {spec.seeds.cap}"
    if plan is None:
        return seeds
    sds = "".join(
        f"; {a}: pilot sd {v['pilot_sd']:.3g} raised to {v['planning_sd']:.3g}" for a, v in plan["arms"].items()
    )
    return seeds + f"; planned {plan['seeds']} per arm (needed {plan['needed']}{sds})"


def protocol(spec, plan: dict | None, treatments: int) -> list[str]:
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
        f"- Arms: {arms}; baseline `{spec.baseline}`; shared overrides: {' '.join(spec.config) or 'none'}",
        f"- Primary: {aggregate_name(P.aggregate)} of {P.metric} per run; each treatment {effect} against the "
        f"baseline; alpha {spec.alpha:g} (Holm across {treatments} treatment(s)), power {spec.power:g}",
        "- Secondary (Holm across every line): "
        + (", ".join(f"{aggregate_name(m.aggregate)} {m.metric}" for m in spec.secondary) or "none"),
        f"- Engagement: {engagement_words(spec.engagement)}",
    ]
    if spec.learning is not None:
        lines.append(
            f"- Learning check: the baseline's {aggregate_name(spec.learning.aggregate)} "
            f"{spec.learning.metric} per run is above 0 with its {1 - spec.alpha:.0%} interval; failing it, "
            "no verdict"
        )
    if spec.controls:
        lines.append(
            "- Controls, beside the baseline on the learning metric: "
            + ", ".join(f"`{c}` ({' '.join(o)})" for c, o in spec.controls.items())
        )
    return lines + [f"- Seeds: {seed_words(spec, plan)}"]


def verdict_lines(spec, r: dict) -> list[str]:
    """A verdict section per treatment: the word, the difference, the reason, the robust statistics."""
    lines = []
    for arm in r["treatments"]:
        word, why = r["verdicts"][arm]
        adjusted = f"adjusted p = {r['p_adjusted'][arm]:.2g}; " if len(r["treatments"]) > 1 else ""
        lines += [
            f"### Verdict, {arm} against {spec.baseline}: {word}",
            "",
            f"{arm} - {spec.baseline}: {r['diffs'][arm].describe()}; {adjusted}{why}.",
            "",
        ]
        rob = stats.robust(*pair(r["values"], spec.baseline, arm), spec.primary.lower, spec.alpha)
        if rob is not None:
            lines += [rob.describe(spec.baseline, arm, spec.primary.lower), ""]
    return lines


def secondary_lines(spec, r: dict) -> list[str]:
    if not r["secondary"]:
        return []
    n = len(r["secondary"])
    lines = [f"### Secondary ({n} line{'s' if n > 1 else ''}, Holm-adjusted p beside each)", ""]
    for (label, d, rob, arm, lower), p_adj in zip(r["secondary"], r["secondary_holm"]):
        extra = "" if math.isnan(p_adj) else f"; Holm-adjusted p = {p_adj:.2g}"
        lines.append(
            f"- {label}: {d.describe()}{extra}" + (f"; {rob.describe(spec.baseline, arm, lower)}" if rob else "")
        )
    return lines + [""]


def provenance_lines(records: list, name: str) -> list[str]:
    """How many runs, on which CPUs, and the command that recomputes every number."""
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
        f"{'; '.join(cpus)}. Every number above: `rlkit-study {name} --analyse-only`.",
        "",
    ]


def report(spec, name: str, results: Path, records: list, plan: dict | None) -> str:
    """The README section: the declared protocol, the plan, the result table, verdicts, secondary
    lines, what was left out and where the numbers come from."""
    r, P = analyse(spec, records, plan), spec.primary
    lines = [
        MARKER,
        "",
        "## Declared protocol (study.yaml)",
        "",
        *protocol(spec, plan, len(r["treatments"])),
        "",
        "## Result",
        "",
        f"| arm | runs | {aggregate_name(P.aggregate)} {P.metric} |",
        "|---|---|---|",
    ]
    for arm in [*spec.arms, *spec.controls]:
        v = list(r["values"].get(arm, {}).values())
        lines.append(f"| {arm} | {len(v)} | {fmt_ci(v)} |")
    lines.append("")
    lines += verdict_lines(spec, r)
    if r["learning"]:
        lines += ["### Learning check", "", *[f"- {x}" for x in r["learning"]], ""]
    lines += ["### Engagement", "", *[f"- {e}" for e in r["engagement"]], ""]
    lines += secondary_lines(spec, r)
    if r["left_out"]:
        lines += ["### Runs left out", "", *[f"- {x}" for x in r["left_out"]], ""]
    lines += provenance_lines(records, name)
    if plot_primary(spec, r["arms"], results):
        lines += [f"![{P.metric}](results/{P.metric.replace('/', '_')}.png)", ""]
    return "\n".join(lines)


def plot_primary(spec, arms: dict, results: Path) -> bool:
    groups = {(arm,): list(arms[arm].values()) for arm in [*spec.arms, *spec.controls] if arms.get(arm)}
    png = results / (spec.primary.metric.replace("/", "_") + ".png")
    return bool(groups) and plot(groups, ["arm"], spec.primary.metric, png)


def write_report(spec, name: str, path: Path, results: Path, records: list, plan: dict | None) -> str:
    """The report, written into README.md beside the study file below MARKER (text above it is kept)."""
    section = report(spec, name, results, records, plan)
    readme = path.parent / "README.md"
    head = readme.read_text().split(MARKER)[0].rstrip() if readme.exists() else f"# Study: {name}"
    atomic.write_text(readme, head + "\n\n" + section)
    return section
