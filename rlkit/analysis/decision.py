"""A declared study's decision, exactly as its study file says: treatments paired with the baseline
by seed, the primary test (Holm across treatments), the gates every verdict passes (each a
`Gate`: one function and its reason), the engagement check, secondary lines (Holm across all of
them) and each treatment's `Verdict`, gathered in an `Analysis`."""

from __future__ import annotations

import dataclasses
import math

from rlkit.analysis import stats
from rlkit.analysis.arms import pair, per_run, runs_by_arm, unpaired
from rlkit.analysis.compare import fmt
from rlkit.analysis.runs import WITHDRAWN, aggregate, aggregate_name
from rlkit.analysis.sequential import Sequence, track
from rlkit.analysis.stats import mean_ci
from rlkit.analysis.study import SAMPLED, START, learner, learning_arm, learning_margin, treatments
from rlkit.analysis.values import Analysis, Bound, Gate, Plan, Reason, Verdict, gate

MIN_PAIRS = 3  # fewer pairs give no verdict


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def fmt_ci(values: list[float]) -> str:
    return fmt(*mean_ci(values)) if values else "n/a"


def sequence(spec, d: list[float], margin: float | None = None) -> Sequence:
    """The anytime-valid state of differences `d` in seed order, at the study's alpha and prior."""
    return track(d, spec.alpha, spec.sequential.prior if spec.sequential else 1.0, margin)


def differences(paired: tuple[list[float], list[float]]) -> list[float]:
    """b - a of each pair (`pair`'s baseline and arm values, in seed order)."""
    return [y - x for x, y in zip(*paired)]


# ---- the gates: each its check, its reason and its lines -------------------------------------------------------------


def start_gate(spec, arms: dict) -> Gate:
    """With `baseline: start` on a sampled metric: whether the start varies across seeds like any
    arm, because each run seed drew its own evaluation samples (`eval.seed_per_run`) or started
    from its own policy (a warm start per seed: its values differ). It fails when one policy was
    sampled with one eval.seed at every seed: one measurement, held. Not declared when the baseline
    is an arm or the metric is greedy (the same model scored the same way)."""
    reason = Reason(
        "the starting policy was measured once: every run drew its sampled evaluation from one eval.seed",
        ", so the start is one measurement held at every seed and its sampling error is missing from the test "
        "(rerun the arms with eval.seed_per_run=true)",
    )
    metric = spec.primary.metric
    if spec.baseline != START or not metric.startswith(SAMPLED):
        return gate(None, reason)
    runs = list(arms.get(learner(spec), {}).values())
    starts = {aggregate(r, metric, "start") for r in runs}
    if all(r.keys.get("eval.seed_per_run", False) for r in runs):
        return gate(True, reason, [f"{metric} is sampled; each run seed drew its own evaluation samples: passed"])
    if len(starts) > 1:
        return gate(
            True, reason, [f"{metric} is sampled with one eval.seed, from {len(starts)} different starts: passed"]
        )
    return gate(
        False,
        reason,
        [
            f"{metric} is sampled, and every run drew its evaluation from one eval.seed, so the start is "
            f"{starts.pop():.4g} at each of {len(runs)} seeds: one measurement, its sampling error missing from the "
            "paired test: FAILED (rerun with eval.seed_per_run=true)"
        ],
    )


def learning_gate(spec, arms: dict) -> Gate:
    """Whether the baseline learned: its mean learning aggregate exceeds the learning margin
    (`learning_margin`) with its whole interval (every run gaining the same amount: that amount);
    a line for it and for each control arm against it."""
    reason = Reason("the baseline did not learn by the learning margin", ", so the testbed cannot show the claim")
    L = spec.learning
    if L is None:
        return gate(None, reason)
    values, name = per_run(arms, L, spec.unfinished), f"{aggregate_name(L.aggregate)} {L.metric}"
    margin, base = learning_margin(spec), learning_arm(spec)
    gains = list(values.get(base, {}).values())
    d = stats.paired([0.0] * len(gains), gains, spec.alpha)
    lo, said = d.interval[0], d.describe()
    if spec.sequential:
        s = sequence(spec, gains)
        lo, said = s.interval[0], s.describe()
    learned = d.n >= 2 and lo > margin
    role, who = ("baseline", "the baseline") if base == spec.baseline else ("arm", base)
    lines = [
        f"{base} ({role}): {name} = {said}, needs its interval above {margin:g}: "
        + ("passed" if learned else f"FAILED, {who} did not learn by the margin")
    ]
    for control in (c for c in spec.controls if c != base):
        own = list(values.get(control, {}).values())
        lines.append(
            f"{control} (control): {name} = {fmt_ci(own)} over {len(own)} runs; {base} - {control}: "
            f"{stats.paired(*reversed(pair(values, base, control)), spec.alpha).describe()}"
        )
    return gate(learned, reason, lines)


def sensitivity_gate(spec, values: dict) -> Gate:
    """Whether the positive control moved the primary metric (its per-run values `values`) away from
    the baseline in its direction, significantly and by at least the smallest effect."""
    reason = Reason(
        "the positive control did not move the primary metric by the smallest effect: the testbed cannot see this "
        "mechanism"
    )
    S = spec.sensitivity
    if S is None:
        return gate(
            None, reason, ["no positive control declared: an equivalence cannot be told from an insensitive testbed"]
        )
    direction, delta = S.direction or spec.primary.direction, spec.primary.smallest_effect
    a, b = pair(values, spec.baseline, S.arm)
    d = stats.paired(a, b, spec.alpha)
    p, said = d.p, d.describe()
    if spec.sequential:
        s = sequence(spec, differences((a, b)))
        p, said = s.p, s.describe()
    sign = 1 if direction == "higher" else -1
    seen = d.n >= MIN_PAIRS and p < spec.alpha and sign * d.diff >= delta
    return gate(
        seen,
        reason,
        [
            f"{S.arm} - {spec.baseline} (positive control, needs {direction} by >= {delta:g}, p < {spec.alpha:g}): "
            f"{said}: " + ("passed" if seen else "FAILED, the testbed does not show the mechanism")
        ],
    )


def premises_gate(spec, arms: dict) -> Gate:
    """Whether every premise held (its arm's mean aggregate within its bound)."""
    reason = Reason("a premise of the claim did not hold on this testbed", " (see Premises)")
    if not spec.premises:
        return gate(None, reason, ["no premise declared"])
    held, lines = True, []
    for p in spec.premises:
        arm = p.arm or learner(spec)
        v = list(per_run(arms, p, spec.unfinished).get(arm, {}).values())
        ok = Bound.of(p).holds(mean(v))
        held = held and ok
        lines.append(
            f"{p.why or p.metric}: {arm}'s {aggregate_name(p.aggregate)} {p.metric} = {mean(v):.4g} over "
            f"{len(v)} runs, needs {Bound.of(p)}: " + ("held" if ok else "FAILED")
        )
    return gate(held, reason, lines)


def engagement_gates(spec, arms: dict, tested: list[str]) -> tuple[dict[str, Gate], list[str]]:
    """{treatment: its engagement gate} and a line per checked arm (each treatment, or the one
    declared arm, whose result then holds for every treatment)."""
    reason = Reason("the engagement check failed: the treatment did not act enough to test the claim")
    e = spec.engagement
    if e is None:
        return {arm: gate(None, reason) for arm in tested}, ["no engagement check declared"]
    values, passed, lines = per_run(arms, e, spec.unfinished), {}, []
    for arm in [e.arm] if e.arm else tested:
        v = list(values.get(arm, {}).values())
        passed[arm] = Bound.of(e).holds(mean(v))
        lines.append(
            f"{arm}: {aggregate_name(e.aggregate)} {e.metric} = {mean(v):.4g} over {len(v)} runs, needs "
            f"{Bound.of(e)}: " + ("passed" if passed[arm] else "FAILED")
        )
    return {arm: gate(passed[e.arm or arm], reason) for arm in tested}, lines


# ---- the verdict ----------------------------------------------------------------------------------------------------


def decide(
    spec, d: stats.Difference, p_sig: float, p_eq: float, gates: dict[str, Gate], seq: Sequence | None = None
) -> Verdict:
    """The verdict for one treatment's primary difference d (treatment - baseline), given its
    Holm-adjusted p of no difference (`p_sig`) and of TOST at the margin (`p_eq`), anytime-valid
    in a sequential design (its confidence sequence `seq`), and its gates (the first in order that
    failed gives the reason)."""
    failed = next((g for g in gates.values() if g.failed), None)
    if failed is not None:
        return Verdict("not tested", failed.reason.text, failed.reason.short)
    if d.n < MIN_PAIRS:
        why = f"only {d.n} paired runs (a verdict needs at least {MIN_PAIRS})"
        return Verdict("inconclusive", why, why)
    word, why = outcome(spec, d, p_sig, p_eq, seq)
    sensitive, held = gates["sensitivity"].declared, gates["premises"].declared
    if word == "equivalent" and not sensitive:
        short = f"no positive control showed that this testbed can see an effect of {spec.primary.smallest_effect:g}"
        return Verdict("not tested", f"{short}, so an equivalence says nothing here ({why})", short)
    ungated = tuple(name for name, ok in (("positive control", sensitive), ("premise", held)) if not ok)
    return Verdict(word, why, word, ungated)


def outcome(spec, d: stats.Difference, p_sig: float, p_eq: float, seq: Sequence | None = None) -> tuple[str, str]:
    """Equivalence testing's outcomes (Lakens 2018) for significance (`p_sig`: against 0, or for a
    claimed equality a difference beyond the margin) and TOST against the declared margin, both
    adjusted: reproduced (significant the claimed way, not inside the margin), negligible
    (significant but inside it), equivalent (not significant, inside it), refuted (significant
    against the claim: for a claimed equality, wholly beyond the margin), inconclusive (neither
    test decides)."""
    delta, alpha, direction = spec.primary.smallest_effect, spec.alpha, spec.primary.direction
    sig, equal = p_sig < alpha, p_eq < alpha
    against = f"beyond ±{delta:g} " if direction == "equal" else ""
    tests = f"{against}adjusted p = {p_sig:.2g}, TOST at ±{delta:g} adjusted p = {p_eq:.2g}"
    if seq is not None:
        tests = f"anytime-valid {tests}; confidence sequence [{seq.interval[0]:+.3g}, {seq.interval[1]:+.3g}]"
    if sig and equal:
        return "negligible", f"a real difference, but inside ±{delta:g} ({tests})"
    if equal:
        return "equivalent", f"no difference as large as {delta:g} either way ({tests})"
    if not sig:
        more = need(spec, d) if seq is None else f"; reached at {seq.n} pairs"
        return "inconclusive", f"neither a difference nor an equivalence is shown ({tests}){more}"
    if direction == "equal":
        return "refuted", f"a difference beyond ±{delta:g} ({tests})"
    if (d.diff > 0) == (direction == "higher"):
        return "reproduced", f"the difference is {direction} than 0 and not inside ±{delta:g} ({tests})"
    return "refuted", f"the difference goes against the claim ({tests})"


def need(spec, d: stats.Difference) -> str:
    """What more seeds would decide, at the observed spread."""
    n = seeds_to_decide(spec, d)
    return f"; about {n} seeds per arm would decide it at the observed spread" if n else ""


def seeds_to_decide(spec, d: stats.Difference) -> int | None:
    """Seeds per arm at which a fixed-sample test has the declared power at the smallest effect, at
    the observed spread (None where it cannot be computed)."""
    if spec.primary.direction == "equal":
        return stats.seeds_for_equivalence(spec.primary.smallest_effect, d.sd, spec.power, spec.alpha)
    return stats.seeds_for_power(spec.primary.smallest_effect, d.sd, True, spec.power, spec.alpha)


def gate_checks(spec, arms: dict, values: dict) -> dict[str, Gate]:
    """The gates every verdict passes, in the order their reasons are given."""
    return {
        "start": start_gate(spec, arms),
        "learning": learning_gate(spec, arms),
        "premises": premises_gate(spec, arms),
        "sensitivity": sensitivity_gate(spec, values),
    }


def primary_tests(spec, tested: list[str], pairs: dict, diffs: dict) -> tuple[dict, dict, dict]:
    """Each treatment's confidence sequence (None in a fixed design) and its Holm-adjusted p of no
    difference (for a claimed equality: of a difference no larger than the smallest effect, since a
    real difference inside the margin does not refute the claim) and of TOST at the smallest effect:
    anytime-valid in a sequential design."""
    delta = spec.primary.smallest_effect
    seqs = {a: sequence(spec, differences(pairs[a]), delta) if spec.sequential else None for a in tested}
    sig = [seqs[a].p if seqs[a] else diffs[a].p for a in tested]
    if spec.primary.direction == "equal":  # against a claimed equality: a difference beyond the margin
        sig = [seqs[a].p_outside if seqs[a] else diffs[a].beyond(delta) for a in tested]
    eq = [seqs[a].p_inside if seqs[a] else diffs[a].tost(delta) for a in tested]
    return seqs, dict(zip(tested, stats.holm(sig))), dict(zip(tested, stats.holm(eq)))


def analyse(spec, records: list, plan: Plan | None, robust: bool = True) -> Analysis:
    """Every number of the report, from the records alone; `robust` False leaves out the bootstrap
    statistics (the slow part), for a summary that needs only the verdicts."""
    tested = treatments(spec)
    arms, unfinished = runs_by_arm(records, spec)
    values = per_run(arms, spec.primary, spec.unfinished)
    pairs = {arm: pair(values, spec.baseline, arm) for arm in tested}
    diffs = {arm: stats.paired(*pairs[arm], alpha=spec.alpha) for arm in tested}
    seqs, p_sig, p_eq = primary_tests(spec, tested, pairs, diffs)
    engaged, engagement_lines = engagement_gates(spec, arms, tested)
    gates = gate_checks(spec, arms, values)
    cap = spec.seeds.cap if plan and plan.capped else None
    verdicts = {
        arm: dataclasses.replace(
            decide(spec, diffs[arm], p_sig[arm], p_eq[arm], {**gates, "engagement": engaged[arm]}, seqs[arm]), cap=cap
        )
        for arm in tested
    }
    secondary = secondary_differences(spec, arms, tested, robust)
    return Analysis(
        treatments=tuple(tested),
        values=values,
        diffs=diffs,
        p_adjusted=p_sig,
        p_tost_adjusted=p_eq,
        robust={
            arm: stats.robust(*pairs[arm], spec.primary.lower, spec.alpha, paired=True) if robust else None
            for arm in tested
        },
        verdicts=verdicts,
        gates=gates,
        engagement=engaged,
        engagement_lines=tuple(engagement_lines),
        secondary=tuple(secondary),
        secondary_holm=tuple(stats.holm([row.p for row in secondary])),
        unfinished=tuple(unfinished),
        unpaired=tuple(line for arm in [*tested, *spec.controls] for line in unpaired(values, spec.baseline, arm)),
        arms=arms,
    )


def secondary_differences(spec, arms: dict, tested: list[str], robust: bool) -> list[stats.Row]:
    """Each secondary metric's paired difference (and, when `robust`, its bootstrap statistics) for
    every treatment. A line declared with a withdrawn aggregate has no difference and stays in
    Holm's family as a missing p."""
    lines = []
    for m in spec.secondary:
        for arm in tested:
            label = f"{aggregate_name(m.aggregate)} {m.metric}: {arm} - {spec.baseline}"
            if m.aggregate in WITHDRAWN:
                lines.append(stats.Row(label, None, None, arm, m.metric, m.lower, WITHDRAWN[m.aggregate]))
                continue
            a, b = pair(per_run(arms, m, spec.unfinished), spec.baseline, arm)
            rob = stats.robust(a, b, m.lower, spec.alpha, paired=True) if robust else None
            lines.append(stats.Row(label, stats.paired(a, b, spec.alpha), rob, arm, m.metric, m.lower))
    return lines


# ---- a sequential design's stopping rule ----------------------------------------------------------------------------


def hopeless(spec, arms: dict, values: dict) -> list[str]:
    """The gates that can no longer pass at any later look: the learning check's confidence sequence
    wholly at or under its margin, the positive control's wholly short of the smallest effect, a
    premise's (of its arm's per-run values) wholly on the wrong side of its bound."""
    out = []
    for p in spec.premises:
        v, bound = list(per_run(arms, p, spec.unfinished).get(p.arm or learner(spec), {}).values()), Bound.of(p)
        lo, hi = sequence(spec, v).interval if v else (math.nan, math.nan)
        if v and not (bound.holds(lo) or bound.holds(hi)):
            out.append(f"a premise cannot hold: {p.why or p.metric} (its sequence [{lo:.3g}, {hi:.3g}], needs {bound})")
    if spec.learning is not None:
        gains = list(per_run(arms, spec.learning, spec.unfinished).get(learning_arm(spec), {}).values())
        hi = sequence(spec, gains).interval[1]
        if hi <= learning_margin(spec):
            out.append(f"the learning check cannot pass (its confidence sequence ends at {hi:.3g})")
    S = spec.sensitivity
    if S is not None:
        sign = 1 if (S.direction or spec.primary.direction) == "higher" else -1
        lo, hi = sequence(spec, differences(pair(values, spec.baseline, S.arm))).interval
        if max(sign * lo, sign * hi) < spec.primary.smallest_effect:
            out.append(f"the positive control cannot reach the smallest effect (its sequence [{lo:.3g}, {hi:.3g}])")
    return out


def settled(spec, a: Analysis) -> str | None:
    """Why a sequential study stops at this look, or None (look again after the next seed): a gate
    that can no longer pass, or every tested gate passed and every treatment's outcome decided
    (significance or equivalence shown, anytime-valid)."""
    lost = hopeless(spec, a.arms, a.values)
    if lost:
        return "; ".join(lost)
    if any(a.gates[g].failed for g in ("learning", "sensitivity")):
        return None
    if all(min(a.p_adjusted[t], a.p_tost_adjusted[t]) < spec.alpha for t in a.treatments):
        return "every tested gate passed and every verdict is decided"
    return None
