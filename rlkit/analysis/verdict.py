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
from rlkit.analysis.runs import WITHDRAWN, RunHistory, aggregate, aggregate_name, from_rows, lower_is_better
from rlkit.analysis.stats import mean_ci
from rlkit.analysis.study import SAMPLED, START, every_arm, learner, learning_margin, treatments
from rlkit.sinks import flatten

MARKER = "<!-- rlkit-study: everything below this line is written by rlkit-study; edits here are replaced -->"


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


MIN_PAIRS = 3  # fewer pairs give no verdict


def decide(spec, d: stats.Difference, p_sig: float, p_eq: float, gates: dict) -> tuple[str, str]:
    """The verdict and its reason for one treatment's primary difference d (treatment - baseline),
    given its Holm-adjusted p of no difference (`p_sig`) and of TOST at the margin (`p_eq`) and
    the gates (`gates`: learned, premises, sensitive, engaged: True, False or None for not declared)."""
    failed = [why for key, why in GATE_WORDS.items() if gates.get(key) is False]
    if failed:
        return "not tested", failed[0]
    if d.n < MIN_PAIRS:
        return "inconclusive", f"only {d.n} paired runs (a verdict needs at least {MIN_PAIRS})"
    word, why = outcome(spec, d, p_sig, p_eq)
    if word == "equivalent" and gates.get("sensitive") is None:
        return "not tested", (
            f"no positive control showed that this testbed can see an effect of {spec.primary.smallest_effect:g}, "
            f"so an equivalence says nothing here ({why})"
        )
    missing = [
        name for name, key in (("positive control", "sensitive"), ("premise", "premises")) if gates.get(key) is None
    ]
    return word + (" (not gated)" if missing else ""), why + (
        f"; not gated: no {' and no '.join(missing)} declared" if missing else ""
    )


GATE_WORDS = {
    "start": "the starting policy was measured once: every run drew its sampled evaluation from one eval.seed, so "
    "the start is one measurement held at every seed and its sampling error is missing from the test (rerun the "
    "arms with eval.seed_per_run=true)",
    "learned": "the baseline did not learn by the learning margin, so the testbed cannot show the claim",
    "premises": "a premise of the claim did not hold on this testbed (see Premises)",
    "sensitive": "the positive control did not move the primary metric by the smallest effect: the testbed "
    "cannot see this mechanism",
    "engaged": "the engagement check failed: the treatment did not act enough to test the claim",
}


def outcome(spec, d: stats.Difference, p_sig: float, p_eq: float) -> tuple[str, str]:
    """Equivalence testing's outcomes (Lakens 2018) for significance against 0 and TOST against the
    declared margin, both adjusted: reproduced (significant the claimed way, not inside the margin),
    negligible (significant but inside it), equivalent (not significant, inside it), refuted
    (significant against the claim), inconclusive (neither test decides)."""
    delta, alpha, direction = spec.primary.smallest_effect, spec.alpha, spec.primary.direction
    sig, equal = p_sig < alpha, p_eq < alpha
    tests = f"adjusted p = {p_sig:.2g}, TOST at ±{delta:g} adjusted p = {p_eq:.2g}"
    if sig and equal:
        return "negligible", f"a real difference, but inside ±{delta:g} ({tests})"
    if equal:
        return "equivalent", f"no difference as large as {delta:g} either way ({tests})"
    if not sig:
        return "inconclusive", f"neither a difference nor an equivalence is shown ({tests}){need(spec, d)}"
    if direction == "equal":
        return "refuted", f"a difference beyond ±{delta:g} ({tests})"
    toward = (d.diff > 0) == (direction == "higher")
    return (
        ("reproduced", f"the difference is {direction} than 0 and not inside ±{delta:g} ({tests})")
        if toward
        else (
            "refuted",
            f"the difference goes against the claim ({tests})",
        )
    )


def need(spec, d: stats.Difference) -> str:
    """What more seeds would decide, at the observed spread."""
    if spec.primary.direction == "equal":
        n = stats.seeds_for_equivalence(spec.primary.smallest_effect, d.sd, spec.power, spec.alpha)
    else:
        n = stats.seeds_for_power(spec.primary.smallest_effect, d.sd, True, spec.power, spec.alpha)
    return f"; about {n} seeds per arm would decide it at the observed spread" if n else ""


def engagement(spec, arms: dict, treatments: list[str]) -> tuple[dict, list[str]]:
    """{treatment: passed} and a line per checked arm (each treatment, or the one declared arm,
    whose result then holds for every treatment); {} when the study declares no check."""
    e = spec.engagement
    if e is None:
        return {}, ["no engagement check declared"]
    values, passed, lines = per_run(arms, e, spec.unfinished), {}, []
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
    """Whether the baseline learned: its mean learning aggregate exceeds the learning margin
    (`learning_margin`) with its whole interval (every run gaining the same amount: that amount); a
    line for it and for each control arm against it. (None, []) when the study declares no check."""
    L = spec.learning
    if L is None:
        return None, []
    values, name = per_run(arms, L, spec.unfinished), f"{aggregate_name(L.aggregate)} {L.metric}"
    margin, base = learning_margin(spec), learner(spec)
    gains = list(values.get(base, {}).values())
    d = stats.paired([0.0] * len(gains), gains, spec.alpha)
    learned = d.n >= 2 and d.interval[0] > margin
    role, who = ("baseline", "the baseline") if base == spec.baseline else ("arm", base)
    lines = [
        f"{base} ({role}): {name} = {d.describe()}, needs its interval above {margin:g}: "
        + ("passed" if learned else f"FAILED, {who} did not learn by the margin")
    ]
    for control in spec.controls:
        own = list(values.get(control, {}).values())
        lines.append(
            f"{control} (control): {name} = {fmt_ci(own)} over {len(own)} runs; {base} - {control}: "
            f"{stats.paired(*reversed(pair(values, base, control)), spec.alpha).describe()}"
        )
    return learned, lines


def sensitivity(spec, values: dict) -> tuple[bool | None, list[str]]:
    """Whether the positive control moved the primary metric (its per-run values `values`) away from
    the baseline in its direction, significantly and by at least the smallest effect."""
    S = spec.sensitivity
    if S is None:
        return None, ["no positive control declared: an equivalence cannot be told from an insensitive testbed"]
    direction, delta = S.direction or spec.primary.direction, spec.primary.smallest_effect
    d = stats.paired(*pair(values, spec.baseline, S.arm), spec.alpha)
    sign = 1 if direction == "higher" else -1
    seen = d.n >= MIN_PAIRS and d.p < spec.alpha and sign * d.diff >= delta
    return seen, [
        f"{S.arm} - {spec.baseline} (positive control, needs {direction} by >= {delta:g}, p < {spec.alpha:g}): "
        f"{d.describe()}: " + ("passed" if seen else "FAILED, the testbed does not show the mechanism")
    ]


def start_measured(spec, arms: dict) -> tuple[bool | None, list[str]]:
    """With `baseline: start` on a sampled metric: whether the start varies across seeds like any
    arm, because each run seed drew its own evaluation samples (`eval.seed_per_run`) or started
    from its own policy (a warm start per seed: its values differ). It fails when one policy was
    sampled with one eval.seed at every seed: one measurement, held. None when the baseline is an
    arm or the metric is greedy (the same model scored the same way)."""
    if spec.baseline != START or not spec.primary.metric.startswith(SAMPLED):
        return None, []
    runs = list(arms.get(learner(spec), {}).values())
    starts = {aggregate(r, spec.primary.metric, "start") for r in runs}
    metric = spec.primary.metric
    if all(r.keys.get("eval.seed_per_run", False) for r in runs):
        return True, [f"{metric} is sampled; each run seed drew its own evaluation samples: passed"]
    if len(starts) > 1:
        return True, [f"{metric} is sampled with one eval.seed, from {len(starts)} different starts: passed"]
    return False, [
        f"{metric} is sampled, and every run drew its evaluation from one eval.seed, so the start is "
        f"{starts.pop():.4g} at each of {len(runs)} seeds: one measurement, its sampling error missing from the paired "
        "test: FAILED (rerun with eval.seed_per_run=true)"
    ]


def premises(spec, arms: dict) -> tuple[bool | None, list[str]]:
    """Whether every premise held (its arm's mean aggregate within its bound); None when none is declared."""
    if not spec.premises:
        return None, ["no premise declared"]
    held, lines = True, []
    for p in spec.premises:
        arm = p.arm or learner(spec)
        v = list(per_run(arms, p, spec.unfinished).get(arm, {}).values())
        mean = sum(v) / len(v) if v else float("nan")
        ok = (mean >= p.at_least) if p.at_least is not None else (mean <= p.at_most)
        held = held and ok
        bound = f">= {p.at_least:g}" if p.at_least is not None else f"<= {p.at_most:g}"
        lines.append(
            f"{p.why or p.metric}: {arm}'s {aggregate_name(p.aggregate)} {p.metric} = {mean:.4g} over {len(v)} runs, "
            f"needs {bound}: " + ("held" if ok else "FAILED")
        )
    return held, lines


def gate_checks(spec, arms: dict, values: dict) -> tuple[dict, dict]:
    """The gates every verdict passes (learned, premises, sensitive: True, False or None for not
    declared) and their report lines."""
    learned, learning_lines = learning(spec, arms)
    sensitive, sensitivity_lines = sensitivity(spec, values)
    held, premise_lines = premises(spec, arms)
    measured, start_lines = start_measured(spec, arms)
    lines = {"learning": learning_lines, "sensitivity": sensitivity_lines, "premises": premise_lines}
    return {"start": measured, "learned": learned, "premises": held, "sensitive": sensitive}, {
        **lines,
        "start": start_lines,
    }


def analyse(spec, records: list, plan: dict | None, robust: bool = True) -> dict:
    """Every number of the report, from the records alone; `robust` False leaves out the secondary
    lines' bootstrap statistics (the slow part), for a summary that needs only the verdicts."""
    tested = treatments(spec)
    arms, unfinished = runs_by_arm(records, spec)
    values = per_run(arms, spec.primary, spec.unfinished)
    diffs = {arm: stats.paired(*pair(values, spec.baseline, arm), alpha=spec.alpha) for arm in tested}
    p_sig = dict(zip(tested, stats.holm([d.p for d in diffs.values()])))
    p_eq = dict(zip(tested, stats.holm([d.tost(spec.primary.smallest_effect) for d in diffs.values()])))
    engaged, engagement_lines = engagement(spec, arms, tested)
    gates, gate_lines = gate_checks(spec, arms, values)
    capped = f"; at the seed cap ({spec.seeds.cap})" if plan and plan.get("capped") else ""
    verdicts = {}
    for arm in tested:
        w, why = decide(spec, diffs[arm], p_sig[arm], p_eq[arm], {**gates, "engaged": engaged.get(arm)})
        verdicts[arm] = (w, why + capped if w.startswith("inconclusive") else why)
    secondary = secondary_differences(spec, arms, tested, robust)
    return {
        "treatments": tested,
        "values": values,
        "diffs": diffs,
        "p_adjusted": p_sig,
        "p_tost_adjusted": p_eq,
        "verdicts": verdicts,
        "engagement": engagement_lines,
        "learned": gates["learned"],
        "sensitive": gates["sensitive"],
        "held": gates["premises"],
        "start_measured": gates["start"],
        **gate_lines,
        "secondary": secondary,
        "secondary_holm": stats.holm([row.p for row in secondary]),
        "unfinished": unfinished,
        "unpaired": [line for arm in [*tested, *spec.controls] for line in unpaired(values, spec.baseline, arm)],
        "arms": arms,
    }


def secondary_differences(spec, arms: dict, treatments: list[str], robust: bool) -> list[stats.Row]:
    """Each secondary metric's paired difference (and, when `robust`, its bootstrap statistics) for
    every treatment. A line declared with a withdrawn aggregate has no difference and stays in
    Holm's family as a missing p."""
    lines = []
    for m in spec.secondary:
        for arm in treatments:
            label = f"{aggregate_name(m.aggregate)} {m.metric}: {arm} - {spec.baseline}"
            if m.aggregate in WITHDRAWN:
                lines.append(stats.Row(label, None, None, arm, m.metric, m.lower, WITHDRAWN[m.aggregate]))
                continue
            a, b = pair(per_run(arms, m, spec.unfinished), spec.baseline, arm)
            rob = stats.robust(a, b, m.lower, spec.alpha, paired=True) if robust else None
            lines.append(stats.Row(label, stats.paired(a, b, spec.alpha), rob, arm, m.metric, m.lower))
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
    gates = "".join(
        f"; {g}: needs {v['needed'] if v['needed'] is not None else 'more than any count (the pilot fell short)'}"
        for g, v in plan.get("gates", {}).items()
    )
    to_cap = "; run to the cap by decision (--to-cap)" if plan.get("to_cap") else ""
    return seeds + f"; planned {plan['seeds']} per arm (needed {plan['needed']}{sds}{gates}){to_cap}"


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
        + (f">= {p.at_least:g}" if p.at_least is not None else f"<= {p.at_most:g}")
        for p in spec.premises
    ] or ["- Premises: none declared"]
    return lines + [f"- Runs that stop early count by: {spec.unfinished}"]


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
            f"- Learning check: {'the baseline' if spec.baseline != START else learner(spec)}'s "
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


def verdict_lines(spec, r: dict) -> list[str]:
    """A verdict section per treatment: the word, the difference, the reason, the robust statistics."""
    lines = []
    for arm in r["treatments"]:
        word, why = r["verdicts"][arm]
        lines += [
            f"### Verdict, {arm} against {spec.baseline}: {word}",
            "",
            f"{arm} - {spec.baseline}: {r['diffs'][arm].describe()}; {why}.",
            "",
        ]
        rob = stats.robust(*pair(r["values"], spec.baseline, arm), spec.primary.lower, spec.alpha, paired=True)
        if rob is not None:
            lines += [rob.describe(spec.baseline, arm, spec.primary.lower), ""]
    return lines


def secondary_lines(spec, r: dict) -> list[str]:
    if not r["secondary"]:
        return []
    n = len(r["secondary"])
    lines = [f"### Secondary ({n} line{'s' if n > 1 else ''}, Holm-adjusted p beside each)", ""]
    for row, p_adj in zip(r["secondary"], r["secondary_holm"]):
        if row.diff is None:
            lines.append(f"- {row.label}: not computed: {row.withdrawn}")
            continue
        extra = "" if math.isnan(p_adj) else f"; Holm-adjusted p = {p_adj:.2g}"
        rob = f"; {row.robust.describe(spec.baseline, row.arm, row.lower)}" if row.robust else ""
        lines.append(f"- {row.label}: {row.diff.describe()}{extra}{rob}")
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


def planned_runs(spec, seeds: int) -> list[tuple[str, int]]:
    """Every arm and control at each of the first `seeds` seeds, seed by seed (pairs complete early)."""
    return [(arm, seed) for seed in range(seeds) for arm in every_arm(spec)]


def missing_runs(spec, records: list, plan: dict | None) -> list[tuple[str, int]]:
    """The runs the study still owes: the planned seeds' (the pilot's while no plan is fixed) not recorded."""
    recorded = {(head["arm"], head["seed"]) for head, _ in records}
    return [run for run in planned_runs(spec, plan["seeds"] if plan else spec.seeds.pilot) if run not in recorded]


def incomplete_lines(name: str, records: list, plan: dict | None, missing: list) -> list[str]:
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


def report(spec, name: str, results: Path, records: list, plan: dict | None) -> str:
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
        v = list(r["values"].get(arm, {}).values())
        lines.append(f"| {arm} | {len(v)} | {fmt_ci(v)} |")
    lines.append("")
    lines += verdict_lines(spec, r)
    if r["start"]:
        lines += ["### Starting policy", "", *[f"- {x}" for x in r["start"]], ""]
    if r["learning"]:
        lines += ["### Learning check", "", *[f"- {x}" for x in r["learning"]], ""]
    lines += ["### Positive control", "", *[f"- {x}" for x in r["sensitivity"]], ""]
    lines += ["### Premises", "", *[f"- {x}" for x in r["premises"]], ""]
    lines += ["### Engagement", "", *[f"- {e}" for e in r["engagement"]], ""]
    lines += secondary_lines(spec, r)
    if r["unfinished"]:
        rule = {"last": "its aggregate over what it logged", "worst": "its arm's worst value"}[spec.unfinished]
        lines += ["### Runs that stopped early (counted, as declared, by " + rule + ")", ""]
        lines += [*[f"- {x}" for x in r["unfinished"]], ""]
    if r["unpaired"]:
        lines += ["### Seeds without a pair", "", *[f"- {x}" for x in r["unpaired"]], ""]
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
