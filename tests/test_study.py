"""Declared studies: the study file is checked, verdicts follow the declared rule (worked by hand
on records the test writes), the plan comes from the pilot's spread, every study in experiments/
composes, and a tiny study runs end to end through real training runs, killed and resumed."""

import dataclasses
import gzip
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from cli import TIMING
from conftest import FAST, make_cfg
from rlkit.analysis import stats
from rlkit.analysis.decision import analyse
from rlkit.analysis.records import check_logged, plan, read_plan, read_records
from rlkit.analysis.runner import longest_first
from rlkit.analysis.runs import aggregate_name, reached
from rlkit.analysis.study import Stopped, StudyError, every_arm, load_spec, overrides
from rlkit.analysis.study_cli import main as study_main
from rlkit.analysis.values import Plan, State, Verdict
from rlkit.analysis.verdict import MARKER, report
from rlkit.session import run
from rlkit.setup import validate

REPO = Path(__file__).resolve().parents[1]


def write_spec(tmp_path, **changes):
    spec = {
        "claim": "t beats b",
        "source": "a paper",
        "arms": {"b": ["algo=grpo"], "t": ["algo=dr_grpo"]},
        "baseline": "b",
        "primary": {"metric": "eval/accuracy", "aggregate": "final", "direction": "higher", "smallest_effect": 0.05},
        "secondary": [{"metric": "train/len", "aggregate": "last:2", "lower": True}],
        "seeds": {"pilot": 2, "cap": 8},
        **changes,
    }
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(spec))
    return load_spec(path)


def rec(arm, seed, acc, length=10.0, finished=True, exit_code=0):
    rows = [
        {"step": 0, "eval/accuracy": 0.3},
        {"step": 1, "eval/accuracy": acc, "train/len": length},
        {"step": 2, "eval/accuracy": acc, "train/len": length},
    ]
    return {
        "arm": arm,
        "seed": seed,
        "exit": exit_code,
        "finished": finished,
        "choices": {},
        "config": {"seed": seed},
        "hardware": {"cpu": "x"},
    }, rows


def records(base, treat, **kw):
    return [rec("b", s, v) for s, v in enumerate(base)] + [rec("t", s, v, **kw) for s, v in enumerate(treat)]


def verdict(spec, recs, plan_=None):
    """The verdict of treatment t as the README heads it, and its reason in full."""
    return words(analyse(spec, recs, plan_))


def capped(spec) -> Plan:
    """A plan that ran to the study's cap."""
    return Plan(spec.seeds.pilot, spec.seeds.cap, spec.alpha, {}, {}, spec.seeds.cap + 1, spec.seeds.cap, True)


def words(r) -> tuple[str, str]:
    v = r.verdicts["t"]
    return v.text, v.why


def passed(g) -> bool | None:
    """A gate's outcome as True (passed), False (failed) or None (not declared)."""
    return None if g.state is State.UNDECLARED else g.state is State.PASSED


def test_a_study_file_that_cannot_run_is_named(tmp_path, capsys):
    with pytest.raises(StudyError, match="primary.direction must be higher, lower or equal"):
        write_spec(tmp_path, primary={"metric": "m", "direction": "up", "smallest_effect": 1})
    with pytest.raises(StudyError, match="baseline 'x' must be one of at least two arms"):
        write_spec(tmp_path, baseline="x")
    with pytest.raises(StudyError, match="Key 'power_target' not in 'StudySpec'"):
        write_spec(tmp_path, power_target=0.9)
    with pytest.raises(StudyError, match="use final, last:K"):
        write_spec(tmp_path, secondary=[{"metric": "m", "aggregate": "last"}])
    assert study_main([str(tmp_path / "nowhere")]) == 2
    assert "no study file" in capsys.readouterr().err


def test_a_withdrawn_aggregate_is_refused_for_new_lines_and_shown_as_withdrawn_where_declared(tmp_path):
    """`auc:tokens` (each run's area over its own token span) is refused as a primary; a study that
    declared it as a secondary line keeps the line in Holm's family, reported as not computed."""
    with pytest.raises(StudyError, match="'auc:tokens' is withdrawn"):
        write_spec(
            tmp_path,
            primary={
                "metric": "eval/accuracy",
                "aggregate": "auc:tokens",
                "direction": "higher",
                "smallest_effect": 0.05,
            },
        )
    spec = write_spec(
        tmp_path,
        secondary=[
            {"metric": "eval/accuracy", "aggregate": "auc:tokens"},
            {"metric": "train/len", "aggregate": "last:2", "lower": True},
        ],
    )
    recs = records([0.3, 0.4, 0.5, 0.35], [0.40, 0.52, 0.61, 0.44], length=12.0)
    r = analyse(spec, recs, None)
    assert r.secondary[0].diff is None and math.isnan(r.secondary_holm[0])
    assert r.secondary_holm[1] == pytest.approx(min(1.0, 2 * r.secondary[1].p))  # two lines in the family
    text = report(spec, "s", tmp_path, recs, None)
    assert "- auc:tokens (withdrawn) eval/accuracy: t - b: not computed: it divided each run's area by" in text


def test_verdicts_follow_the_four_outcomes_of_equivalence_testing(tmp_path):
    spec = write_spec(tmp_path)  # higher by 0.05; no positive control, no premise: "not gated"
    word, why = verdict(spec, records([0.3, 0.4, 0.5, 0.35], [0.40, 0.52, 0.61, 0.44]))  # +0.105 on average
    # t = 0.105 / (0.0129 / 2) = 16.3 on 3 df: p = 0.00051; TOST's upper test (0.105 - 0.05) / se = 8.5: p = 0.998
    assert word == "reproduced (not gated)" and "adjusted p = 0.00051, TOST at ±0.05 adjusted p = 1" in why
    assert why.endswith("not gated: no positive control and no premise declared")
    word, why = verdict(spec, records([0.3, 0.4, 0.5, 0.35], [0.32, 0.421, 0.519, 0.37]))  # +0.02 with sd 0.0008
    assert word == "negligible (not gated)" and "a real difference, but inside ±0.05" in why  # was "reproduced"
    assert verdict(spec, records([0.3, 0.4, 0.5], [0.1, 0.15, 0.3]))[0] == "refuted (not gated)"  # -0.217, p = 0.006
    near = records([0.3, 0.4, 0.5, 0.35, 0.45], [0.301, 0.398, 0.5015, 0.349, 0.4505])  # mean 0.0000, sd 0.0015
    word, why = verdict(spec, near)
    assert word == "not tested" and why.startswith("no positive control showed that this testbed can see an effect")
    word, why = verdict(spec, records([0.3, 0.4, 0.5], [0.4, 0.3, 0.55]), capped(spec))  # +0.017, sd 0.104
    assert word == "inconclusive (not gated)" and "neither a difference nor an equivalence is shown" in why
    assert "seeds per arm would decide it" in why and "at the seed cap (8)" in why
    equal = write_spec(
        tmp_path,
        primary={"metric": "eval/accuracy", "aggregate": "final", "direction": "equal", "smallest_effect": 0.05},
    )
    assert verdict(equal, records([0.3, 0.4, 0.5], [0.6, 0.72, 0.8]))[0] == "refuted (not gated)"
    two = write_spec(tmp_path, arms={"b": ["algo=grpo"], "t": ["algo=dr_grpo"], "u": ["algo=rloo"]})
    recs = records([0.3, 0.4, 0.5, 0.35], [0.32, 0.421, 0.519, 0.37]) + [
        rec("u", s, v) for s, v in enumerate([0.301, 0.398, 0.5015, 0.349])
    ]
    r = analyse(two, recs, None)  # TOST's p goes through Holm across the treatments too, not only significance
    raw = [r.diffs[a].tost(0.05) for a in ("t", "u")]
    assert list(r.p_tost_adjusted.values()) == pytest.approx(stats.holm(raw))
    assert min(r.p_tost_adjusted.values()) == pytest.approx(2 * min(raw))  # the smaller raw p times m = 2
    engaged = write_spec(tmp_path, engagement={"metric": "train/len", "aggregate": "final", "at_least": 11})
    assert verdict(engaged, records([0.3, 0.4, 0.5, 0.35], [0.40, 0.52, 0.61, 0.44]))[0] == "not tested"
    in_base = write_spec(tmp_path, engagement={"metric": "train/len", "aggregate": "final", "at_least": 11, "arm": "b"})
    recs = records([0.3, 0.4, 0.5, 0.35], [0.40, 0.52, 0.61, 0.44], length=12.0)  # only t's runs reach 11
    assert verdict(in_base, recs)[0] == "not tested"  # the declared arm (the baseline) is the one checked
    assert list(analyse(in_base, recs, None).engagement_lines) == [
        "b: final train/len = 10 over 4 runs, needs >= 11: FAILED"
    ]
    with pytest.raises(StudyError, match="engagement.arm 'x' is not one of the arms"):
        write_spec(tmp_path, engagement={"metric": "m", "at_least": 1, "arm": "x"})


def test_no_verdict_from_fewer_than_three_pairs_and_one_from_a_difference_without_spread(tmp_path):
    spec = write_spec(tmp_path)
    word, why = verdict(spec, records([0.3, 0.4], [0.301, 0.401]))  # +0.001 in both pairs: once "reproduced"
    assert word == "inconclusive" and "only 2 paired runs (a verdict needs at least 3)" in why
    word, why = verdict(spec, records([0.3, 0.4, 0.5], [0.4, 0.5, 0.6]))  # +0.1 in every pair: p = 0, the limit
    assert word.startswith("reproduced") and "adjusted p = 0," in why  # once "inconclusive: no spread, no test"
    word, _ = verdict(spec, records([0.3, 0.4, 0.5], [0.4, 0.52, 0.59]))  # the weaker, less consistent result
    assert word.startswith("reproduced")


def gated(tmp_path, **changes):
    """A study with a positive control `c` (higher by the smallest effect) and a premise on the start."""
    premise = {"metric": "eval/accuracy", "at_most": 0.35, "why": "the start is far from the ceiling"}
    return write_spec(tmp_path, **{**gated_args(), "premises": [premise], **changes})


def test_a_positive_control_a_premise_and_the_learning_margin_gate_every_verdict(tmp_path):
    spec = gated(tmp_path)
    base, near = [0.4, 0.45, 0.5, 0.42, 0.47], [0.401, 0.448, 0.5015, 0.419, 0.4705]  # base gains 0.10 .. 0.20
    moved = [rec("c", s, v + 0.1 + 0.01 * (s % 2)) for s, v in enumerate(base)]  # the control: +0.10 or +0.11
    r = analyse(spec, records(base, near) + moved, None)
    assert r.learned and passed(r.gates["sensitivity"]) and passed(r.gates["premises"])
    assert r.verdicts["t"].text == "equivalent"  # the testbed showed it can see +0.05, so the null means something
    assert (
        r.gates["sensitivity"]
        .lines[0]
        .startswith("c - b (positive control, needs higher by >= 0.05, p < 0.05): +0.104 [")
    )
    assert list(r.gates["premises"].lines) == [
        "the start is far from the ceiling: b's step-0 value eval/accuracy = 0.3 over 5 runs, needs <= 0.35: held"
    ]
    weak = [rec("c", s, v + 0.03 + 0.01 * (s % 2)) for s, v in enumerate(base)]  # +0.034: significant, too small
    word, why = words(analyse(spec, records(base, near) + weak, None))
    assert word == "not tested" and why.startswith("the positive control did not move the primary metric")
    high_start = write_spec(tmp_path, **{**gated_args(), "premises": [{"metric": "eval/accuracy", "at_most": 0.2}]})
    word, why = words(analyse(high_start, records(base, near) + moved, None))
    assert word == "not tested" and why.startswith("a premise of the claim did not hold")
    slow = records([0.35, 0.36, 0.38, 0.37, 0.36], [0.36, 0.36, 0.38, 0.38, 0.36])  # gains 0.05 .. 0.08: > 0 only
    r = analyse(spec, slow + [rec("c", s, 0.5) for s in range(5)], None)
    assert r.learned is False and r.verdicts["t"].text == "not tested"  # interval [+0.045, +0.077] not > 0.05
    assert (
        "needs its interval above 0.05: FAILED, the baseline did not learn by the margin"
        in r.gates["learning"].lines[0]
    )
    ceiling = records([0.9] * 5, near)  # every run of b from 0.3 to 0.9: one gain five times, no spread
    r = analyse(spec, ceiling + moved, None)
    assert r.learned is True  # +0.6 in every run: past the margin (once "no spread, so there is no test")
    line = r.gates["learning"].lines[0]
    assert "+0.600 in every one of 5 pairs (no spread: p = 0" in line and line.endswith("passed")
    flat = records([0.3] * 5, near)  # every run of b gains nothing
    assert analyse(spec, flat + moved, None).learned is False
    default = write_spec(tmp_path, learning={"aggregate": "gain:2"})  # margin: twice the smallest effect, 0.1
    assert analyse(default, records(base, near), None).learned is False  # gains +0.148 [+0.099, +0.197]
    assert analyse(default, records([0.5, 0.55, 0.6, 0.52, 0.57], near), None).learned is True  # [+0.199, ...]
    assert analyse(default, slow, None).learned is False
    with pytest.raises(StudyError, match="sensitivity.arm 'x' must be one of the controls"):
        write_spec(tmp_path, **{**gated_args(), "sensitivity": {"arm": "x"}})


def gated_args() -> dict:
    return {
        "controls": {"c": ["loss.eps_high=10"]},
        "learning": {"aggregate": "gain:2", "margin": 0.05},
        "sensitivity": {"arm": "c"},
    }


def test_a_run_that_stopped_early_is_counted_by_the_declared_rule_never_dropped(tmp_path):
    base, treat = [0.4, 0.45, 0.5, 0.42, 0.47], [0.5, 0.55, 0.6, 0.52, 0.57]  # +0.10 in every finished pair
    recs = records(base, treat)
    recs[-1] = rec("t", 4, 0.9, finished=False, exit_code=3)  # diverged after logging 0.9 (its last evaluation)
    last = analyse(write_spec(tmp_path), recs, None)
    assert last.values["t"][4] == 0.9 and last.diffs["t"].n == 5  # counted as it stood, not dropped
    assert list(last.unfinished) == ["t seed 4: stopped at step 2 (exit 3)"]
    worst = analyse(write_spec(tmp_path, unfinished="worst"), recs, None)
    assert worst.values["t"][4] == 0.5 and worst.diffs["t"].diff == pytest.approx((0.1 * 4 + 0.5 - 0.47) / 5)
    recs.append(rec("b", 5, 0.2))  # a seed the treatment never ran: named, not silently intersected away
    assert list(analyse(write_spec(tmp_path), recs, None).unpaired) == [
        "t - b: seed 5 has no value in t; its pair is missing"
    ]
    text = report(write_spec(tmp_path, unfinished="worst"), "s", tmp_path, recs, None)
    assert "### Runs that stopped early (counted, as declared, by its arm's worst value)" in text
    assert "- t seed 4: stopped at step 2 (exit 3)" in text and "### Seeds without a pair" in text


def test_a_study_can_draw_each_seeds_starting_policy_from_its_own_seed(tmp_path):
    spec = write_spec(tmp_path, config=["warm_start.seed=\\${seed}", "warm_start.steps=20"])  # as YAML spells it
    assert spec.config[0] == "warm_start.seed=${seed}"  # the interpolation reaches the run, not the study file
    for seed in (0, 1):
        cfg = make_cfg([*spec.config, f"seed={seed}"], cache_dir=str(tmp_path / "cache"))
        assert cfg.warm_start.seed == seed
        run(cfg, str(tmp_path / f"run{seed}"))
    weights = sorted((tmp_path / "cache").glob("*/weights.pt"))  # one starting policy per seed, each cached
    assert len(weights) == 2 and weights[0].read_bytes() != weights[1].read_bytes()


def test_the_plan_works_when_a_treatment_left_no_pilot_value(tmp_path):
    spec = write_spec(tmp_path, seeds={"pilot": 3, "cap": 8})
    pilot = [rec("b", s, v) for s, v in enumerate([0.3, 0.4, 0.5])]  # every t run of the pilot crashed at once
    p = plan(spec, pilot + [({**rec("t", s, 0)[0], "finished": False, "exit": 1}, []) for s in range(3)])
    assert p.arms["t"].pilot_pairs == 0 and p.seeds == 3  # no spread to plan from: the pilot's count


def test_the_cost_to_reach_a_target_counts_runs_that_never_reach_it_at_their_end(tmp_path):
    spec = write_spec(
        tmp_path,
        primary={"metric": "eval/accuracy", "aggregate": "reach:0.5", "direction": "lower", "smallest_effect": 1},
    )
    recs = records([0.5, 0.4, 0.55], [0.6, 0.7, 0.45])  # b reaches 0.5 at step 1, never, step 1; t: 1, 1, never
    r = analyse(spec, recs, None)
    assert r.values == {"b": {0: 1.0, 1: 2.0, 2: 1.0}, "t": {0: 1.0, 1: 1.0, 2: 2.0}}  # the end: step 2, censored
    run = r.arms["b"][1]
    assert not reached(run, "eval/accuracy", "reach:0.5") and reached(r.arms["b"][0], "eval/accuracy", "reach:0.5")
    assert aggregate_name("reach:0.5:tokens") == "generated tokens to reach 0.5"


def sampled_rec(seed, final, start, per_run):
    """A run logging a sampled metric, eval/pass@4, from `start` at step 0 to `final`."""
    head, _ = rec("t", seed, final)
    head["config"] = {"seed": seed, "eval": {"seed": 0, "seed_per_run": per_run}}
    return head, [{"step": 0, "eval/pass@4": start}, {"step": 1, "eval/pass@4": final}]


def test_a_start_sampled_once_for_every_seed_gives_no_verdict(tmp_path):
    """`baseline: start` on a sampled metric: with one eval.seed for every run the start is one
    measurement held at every seed (0.60 here), so the paired test leaves out its sampling error
    and no verdict is given; with eval.seed_per_run each seed's start is its own draw."""
    primary = {"metric": "eval/pass@4", "aggregate": "final", "direction": "higher", "smallest_effect": 0.05}
    spec = write_spec(tmp_path, arms={"t": ["algo=grpo"]}, baseline="start", primary=primary, secondary=[])
    once = [sampled_rec(s, v, 0.60, False) for s, v in enumerate([0.70, 0.72, 0.69, 0.71])]
    r = analyse(spec, once, None)
    word, why = words(r)
    assert word == "not tested" and why.startswith("the starting policy was measured once")
    assert (
        passed(r.gates["start"]) is False
        and "the start is 0.6 at each of 4 seeds: one measurement" in r.gates["start"].lines[0]
    )
    assert "### Starting policy" in report(spec, "s", tmp_path, once, None)
    draws = [(0.70, 0.61), (0.72, 0.58), (0.69, 0.62), (0.71, 0.6)]  # (final, start) at each seed
    own = [sampled_rec(s, v, u, True) for s, (v, u) in enumerate(draws)]
    r = analyse(spec, own, None)
    assert passed(r.gates["start"]) is True and r.verdicts["t"].text == "reproduced (not gated)"
    own_starts = [sampled_rec(s, v, u, False) for s, (v, u) in enumerate(draws)]  # a warm start per seed
    assert passed(analyse(spec, own_starts, None).gates["start"]) is True
    greedy = write_spec(tmp_path, arms={"t": ["algo=grpo"]}, baseline="start")  # eval/accuracy: the same model
    assert (
        passed(analyse(greedy, [rec("t", s, v) for s, v in enumerate([0.4, 0.42, 0.38])], None).gates["start"]) is None
    )


def test_a_study_against_the_starting_policy_pairs_each_run_with_its_own_step_zero(tmp_path):
    """`baseline: start`: each seed's starting policy is its step-0 evaluation held (0.3 in every
    record here), so the primary difference is each run's final minus its start, by hand: 0.10, 0.12,
    0.08, 0.11 -> mean 0.1025, sd 0.01708, t = 12.0 on 3 df; the learning check and the premises
    read the first arm."""
    spec = write_spec(
        tmp_path,
        arms={"t": ["algo=grpo"]},
        baseline="start",
        learning={"aggregate": "gain:1", "margin": 0.05},
        premises=[{"metric": "eval/accuracy", "at_most": 0.5}],
    )
    recs = [rec("t", s, v) for s, v in enumerate([0.40, 0.42, 0.38, 0.41])]
    r = analyse(spec, recs, None)
    assert r.values["start"] == {s: 0.3 for s in range(4)} and r.treatments == ("t",)
    d = r.diffs["t"]
    assert d.n == 4 and d.diff == pytest.approx(0.1025) and d.sd == pytest.approx(0.017078, rel=1e-4)
    assert d.p == pytest.approx(2 * stats_t_sf(0.1025 / (0.017078 / 2), 3), rel=1e-3)
    assert (
        r.verdicts["t"].text == "reproduced (not gated)" and r.learned and passed(r.gates["premises"])
    )  # no positive control
    assert (
        r.gates["learning"].lines[0].startswith("t (arm): final minus step 0 eval/accuracy = +0.103 [+0.075, +0.130]")
    )
    assert "t's step-0 value eval/accuracy = 0.3 over 4 runs" in r.gates["premises"].lines[0]
    check_logged(spec, recs)  # the premise's metric is looked for in the first arm's runs (start has none)
    assert plan(spec, recs).arms["t"].pilot_pairs == 2  # the pilot's seeds (2), paired with their start
    assert "baseline `start` (each seed's starting policy" in report(spec, "s", tmp_path, recs, None)
    with pytest.raises(StudyError, match="baseline 'start' needs at least one arm and no arm or control named"):
        write_spec(tmp_path, arms={"start": ["algo=grpo"]}, baseline="start")


def stats_t_sf(t: float, df: int) -> float:
    from scipy.stats import t as student

    return float(student.sf(t, df))


def test_a_baseline_that_does_not_learn_gives_no_verdict_and_controls_stand_beside_it(tmp_path):
    spec = write_spec(
        tmp_path, learning={"aggregate": "gain:2", "margin": 0.05}, controls={"c": ["reward.shuffle=group"]}
    )
    flat = records([0.3, 0.31, 0.29, 0.3], [0.40, 0.52, 0.61, 0.44])  # baseline gains 0, +0.01, -0.01, 0 over 0.3
    assert verdict(spec, flat) == (
        "not tested",
        "the baseline did not learn by the learning margin, so the testbed cannot show the claim",
    )
    learns = records([0.4, 0.45, 0.5, 0.42], [0.5, 0.56, 0.6, 0.53])  # gains 0.10, 0.15, 0.20, 0.12; t: +0.10, +0.11
    learns += [rec("c", s, v) for s, v in enumerate([0.3, 0.28, 0.31, 0.3])]  # the control: gains 0, -0.02, +0.01, 0
    r = analyse(spec, learns, None)
    assert r.learned and r.verdicts["t"].text == "reproduced (not gated)"  # gains +0.143 [+0.073, +0.212]
    assert r.gates["learning"].lines[0].startswith("b (baseline): mean of last 2 minus step 0 eval/accuracy = +0.143 [")
    assert (
        r.gates["learning"]
        .lines[1]
        .startswith("c (control): mean of last 2 minus step 0 eval/accuracy = -0.002 ± 0.020 over 4 runs")
    )
    assert "b - c: +0.145 [" in r.gates["learning"].lines[1]  # per seed 0.10, 0.17, 0.19, 0.12
    text = report(spec, "s", tmp_path, learns, None)
    assert "### Learning check" in text and "| c | 4 |" in text and "- Controls, beside the baseline" in text
    with pytest.raises(StudyError, match="declare `learning` too"):
        write_spec(tmp_path, controls={"c": ["reward.shuffle=group"]})
    with pytest.raises(StudyError, match="a control may not share an arm's name: t"):
        write_spec(tmp_path, learning={}, controls={"t": ["reward.shuffle=group"]})


def test_the_analysis_pairs_by_seed_and_corrects_secondary_lines(tmp_path):
    spec = write_spec(tmp_path)
    recs = records([0.3, 0.4, 0.5, 0.35], [0.40, 0.52, 0.61, 0.44])  # differences 0.10, 0.12, 0.11, 0.09: mean 0.105
    recs.append(rec("b", 5, 0.2))  # no partner: unpaired, not in the primary test, and named
    r = analyse(spec, recs, None)
    d = r.diffs["t"]
    assert (
        d.n == 4
        and d.diff == pytest.approx(0.105)
        and list(r.unpaired) == ["t - b: seed 5 has no value in t; its pair is missing"]
    )
    line = r.secondary[0]
    assert line.label == "mean of last 2 train/len: t - b" and line.diff.zero_variance  # every length 10 in both arms


def test_the_plan_comes_from_the_pilot_spread_at_the_declared_effect(tmp_path):
    spec = write_spec(tmp_path, seeds={"pilot": 3, "cap": 8})
    pilot = records([0.3, 0.4, 0.5], [0.33, 0.47, 0.52])  # differences 0.03, 0.07, 0.02: sd 0.026458
    p = plan(spec, pilot + [rec("b", 3, 0.9), rec("t", 3, 0.1)])  # seeds past the pilot do not count
    sd = stats.inflated_sd(0.026458, 3, 0.8)
    assert p.arms["t"].pilot_sd == pytest.approx(0.026458, abs=1e-5)
    assert p.needed == stats.seeds_for_power(0.05, sd, True) and p.seeds == min(8, p.needed)


def test_the_plan_covers_the_positive_control_and_the_learning_check(tmp_path):
    """The gates that need power are planned from the pilot like the primary: the positive control at
    its pilot effect (significant, and its mean past the smallest effect), the learning check at its
    gains' excess over the margin; a gate whose pilot fell short of its bound is named."""
    spec = gated(tmp_path, seeds={"pilot": 3, "cap": 40})
    base, near = [0.40, 0.45, 0.50], [0.41, 0.44, 0.52]
    control = [rec("c", s, v + d) for s, (v, d) in enumerate(zip(base, [0.05, 0.09, 0.07]))]  # +0.07, sd 0.02
    p = plan(spec, records(base, near) + control)
    c, sd = p.gates["positive control"], stats.inflated_sd(0.02, 3, 0.8)
    assert c.pilot_effect == pytest.approx(0.07) and c.planning_sd == pytest.approx(sd)
    # the mean past 0.05 with power 0.8: (0.8416 * sd / 0.02)^2 = 3.2 -> 4 pairs; significance needs 6
    by_hand = math.ceil((stats.sps.norm.ppf(0.8) * sd / 0.02) ** 2)
    assert by_hand == 4 and c.needed == stats.seeds_for_power(0.07, sd, True) == 6
    learn = p.gates["learning check"]  # gains 0.10, 0.15, 0.20 against the margin 0.05 (gated_args)
    assert learn.pilot_effect == pytest.approx(0.15) and learn.needed == stats.seeds_for_power(
        0.10, stats.inflated_sd(0.05, 3, 0.8), True
    )
    assert p.needed == max(p.arms["t"].needed, c.needed, learn.needed) and p.short == ()
    weak = [rec("c", s, v + 0.02) for s, v in enumerate(base)]  # +0.02: below the smallest effect
    p = plan(spec, records(base, near) + weak)
    assert p.gates["positive control"].needed is None and p.short == ("positive control",)


def test_a_plan_that_foreseeably_cannot_decide_stops_after_the_pilot_for_a_decision(tmp_path, monkeypatch, capsys):
    """Past the cap the study stops (exit 4) naming what each part needs, and runs on only when told
    (`--to-cap`, kept in plan.json). The pilot's records are written here and the runs after it are
    counted instead of trained (the tiny study below trains real runs end to end)."""
    from rlkit.analysis import runner
    from rlkit.analysis.records import record_path
    from rlkit.analysis.study import declared

    folder = tmp_path / "experiments" / "noisy"
    folder.mkdir(parents=True)
    spec = write_spec(folder, seeds={"pilot": 3, "cap": 5})
    for head, rows in records([0.3, 0.4, 0.5], [0.2, 0.6, 0.45]):  # sd 0.15 against an effect of 0.05: ~60 seeds
        head.update(declared=declared(spec), overrides=overrides(spec, head["arm"]), rows=len(rows))
        path = record_path(folder / "results", head["arm"], head["seed"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress((json.dumps(head) + "\n" + "\n".join(map(json.dumps, rows))).encode()))
    asked = []
    monkeypatch.setattr(runner, "run_seeds", lambda spec, name, seeds, *a: asked.append(seeds))
    monkeypatch.chdir(tmp_path)
    assert study_main(["noisy"]) == 4
    err = capsys.readouterr().err
    assert "rlkit-study: decision needed: noisy: the plan needs" in err and "past the cap of 5" in err
    assert "`rlkit-study noisy --to-cap` runs the planned 5 seeds anyway" in err and asked == [3]
    assert study_main(["noisy"]) == 4 and asked == [3, 3]  # asked again: no decision was taken
    assert study_main(["noisy", "--to-cap"]) == 0 and asked[-2:] == [3, 5]
    assert json.loads((folder / "results" / "plan.json").read_text())["to_cap"] is True
    capsys.readouterr()
    assert study_main(["noisy"]) == 0 and asked[-1] == 5  # the decision is kept


def test_no_verdict_or_comparison_is_reported_while_planned_runs_are_missing(tmp_path):
    """An interim look could steer a study, so its report shows the protocol and the runs still to
    come, and no comparison, until every run of the pilot (no plan yet) or of the plan is recorded."""
    spec = write_spec(tmp_path)  # pilot 2 seeds
    pilot = records([0.3, 0.35], [0.5, 0.55])
    text = report(spec, "s", tmp_path, pilot[:1] + pilot[2:3], None)
    assert "Incomplete: 2 of 4 pilot runs recorded (to come: b seed 1, t seed 1)" in text
    assert "### Verdict" not in text and "0.5" not in text.split("## Result")[1]
    fixed = dataclasses.replace(plan(spec, pilot), seeds=3)  # the plan asks for a third seed
    text = report(spec, "s", tmp_path, pilot, fixed)
    assert "Incomplete: 4 of 6 planned runs recorded (to come: b seed 2, t seed 2)" in text
    assert "planned 3 per arm" in text and "### Verdict" not in text
    done = report(spec, "s", tmp_path, pilot + [rec("b", 2, 0.4), rec("t", 2, 0.6)], fixed)
    assert "Incomplete" not in done and "### Verdict, t against b" in done and "| t | 3 |" in done


@pytest.mark.parametrize("study", sorted(p.parent.name for p in (REPO / "experiments").glob("*/study.yaml")))
def test_every_declared_study_loads_and_its_arms_compose(study):
    """Each arm composes as the study runs it (its config, the arm's overrides, seed and threads)
    and passes the checks that need no model."""
    spec = load_spec(REPO / "experiments" / study / "study.yaml")
    for arm in every_arm(spec):
        with initialize_config_module(config_module="rlkit.conf", version_base=None):
            cfg = compose("config", overrides=overrides(spec, arm))
        validate(cfg)
        assert cfg.steps >= 1


# the primary is a metric the two arms always differ on (their advantages' scales differ), so the pilot's
# differences spread and the planned count passes the cap of 2 whatever the runs sample
TINY = """claim: Dr. GRPO's updates are larger than GRPO's on the tiny testbed.
source: the test
config: {config}
arms:
  grpo: [algo=grpo]
  dr_grpo: [algo=dr_grpo]
baseline: grpo
primary: {{metric: train/grad_norm, aggregate: "last:2", direction: higher, smallest_effect: 0.01}}
secondary:
  - {{metric: eval/accuracy, aggregate: "last:2"}}
engagement: {{metric: train/frac_zero_std_groups, aggregate: "last:2", at_most: 1.0}}
seeds: {{pilot: 2, cap: 2}}
"""


@pytest.mark.slow
def test_a_tiny_study_runs_end_to_end_and_resumes_after_sigterm_and_kill(tmp_path, warm_cache, capsys, monkeypatch):
    folder = tmp_path / "experiments" / "tiny"
    folder.mkdir(parents=True)
    (folder / "study.yaml").write_text(TINY.format(config=json.dumps([*FAST, f"warm_start.cache_dir={warm_cache}"])))
    (folder / "README.md").write_text("# Tiny\n\nHand-written setup, kept.\n")
    cmd = [sys.executable, "-m", "rlkit.analysis.study_cli", "tiny"]
    runs = tmp_path / "outputs" / "studies" / "tiny"

    def start_and_wait_for(path):
        proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True)
        t0 = time.time()
        while not path.exists():
            assert proc.poll() is None and time.time() - t0 < 300, proc.stderr.read()[-3000:]
            time.sleep(0.02)
        return proc

    # SIGTERM while the pilot's second run starts: the run stops, the study exits 75 and says so
    proc = start_and_wait_for(runs / "dr_grpo" / "seed_0")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    assert "rerun the same command to resume" in proc.stderr.read()
    # kill -9 of the study and its run while the pilot's third run trains
    first = (folder / "results" / "runs" / "grpo_seed0.jsonl.gz").read_bytes()
    proc = start_and_wait_for(runs / "grpo" / "seed_1")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "results" / "runs" / "grpo_seed0.jsonl.gz").read_bytes() == first  # recorded: not rerun
    for interrupted in ("dr_grpo/seed_0", "grpo/seed_1"):  # rerun with the same command
        assert (runs / f"{interrupted}.log").read_text().count("$ ") == 2
    heads = [h for h, _ in read_records(folder / "results")]
    assert sorted((h["arm"], h["seed"]) for h in heads) == sorted((a, s) for a in ("grpo", "dr_grpo") for s in range(2))
    fixed = read_plan(folder / "results" / "plan.json")
    assert fixed.capped and fixed.seeds == 2  # the planned count passes the cap of 2
    for name in ("dr_grpo_seed0", "grpo_seed1"):
        rows = gzip.decompress((folder / "results" / "runs" / f"{name}.jsonl.gz").read_bytes()).decode().splitlines()
        assert [json.loads(r)["step"] for r in rows[1:]] == [0, 1, 2]
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# Tiny\n\nHand-written setup, kept.\n") and MARKER in readme
    assert (
        "### Verdict, dr_grpo against grpo: " in readme and "| grpo | 2 |" in readme and done.stdout.strip() in readme
    )
    assert (folder / "results" / "train_grad_norm.png").exists()
    monkeypatch.chdir(tmp_path)  # the command as a user types it, in this process (its refusals and analysis)
    assert study_main(["tiny", "--analyse-only"]) == 0 and (folder / "README.md").read_text() == readme  # one command
    capsys.readouterr()
    # a study file changed under its results is refused, naming what changed, by a rerun and by the
    # analysis alike; nothing is lost
    declared = (folder / "study.yaml").read_text()
    (folder / "study.yaml").write_text(declared.replace("smallest_effect: 0.01", "smallest_effect: 0.02"))
    assert study_main(["tiny"]) == 2 and "primary.smallest_effect: 0.01 -> 0.02" in capsys.readouterr().err
    assert study_main([str(folder / "study.yaml"), "--analyse-only"]) == 2
    assert "differs from the declaration in" in capsys.readouterr().err
    (folder / "study.yaml").write_text(declared.replace("[algo=dr_grpo]", "[algo=dr_grpo, loss.beta=0.1]"))
    assert study_main(["tiny"]) == 2 and "dr_grpo seed 0 was recorded with overrides" in capsys.readouterr().err
    assert study_main([str(folder / "study.yaml"), "--analyse-only"]) == 2
    (folder / "study.yaml").write_text(
        declared.replace("smallest_effect: 0.01}", "smallest_effect: 0.01, lower: true}")
    )
    assert study_main([str(folder / "study.yaml"), "--analyse-only"]) == 2  # a key the old plans did not keep
    assert "primary.lower: False -> True" in capsys.readouterr().err
    assert len(read_records(folder / "results")) == 4 and (folder / "README.md").read_text() == readme
    (folder / "study.yaml").write_text(declared)
    damaged_study_files_are_named(folder, readme, capsys)
    # the same study two runs at a time: the same records (each run on one thread either way)
    twin = tmp_path / "experiments" / "twin"
    twin.mkdir()
    (twin / "study.yaml").write_text(declared)
    both = subprocess.run(
        [sys.executable, "-m", "rlkit.analysis.study_cli", "twin", "--jobs", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert both.returncode == 0, both.stderr[-3000:]

    def kept(results):  # each record's metric rows, without the timing keys
        return {
            (h["arm"], h["seed"]): [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]
            for h, rows in read_records(results)
        }

    assert kept(twin / "results") == kept(folder / "results")
    assert all(h["wall_s"] > 0 for h, _ in read_records(twin / "results"))  # each run's wall time, from its summary

    def timeless(out):  # the report but for the runs' wall times (its compute line)
        return re.sub(r"compute: [\d.]+ run-hours[^;]*? a seed of every arm\)", "", out.split("## Result")[1])

    assert timeless(both.stdout) == timeless(done.stdout).replace("rlkit-study tiny", "rlkit-study twin")


def damaged_study_files_are_named(folder, readme, capsys):
    """Cut, re-packed and unparsable study files: exit 2 naming the file and what to do; the
    intact records are untouched and analyse again once the damage is undone."""
    results, study = folder / "results", str(folder / "study.yaml")
    record = results / "runs" / "grpo_seed1.jsonl.gz"
    intact, plan_text, declared = record.read_bytes(), (results / "plan.json").read_text(), Path(study).read_text()
    rows = gzip.decompress(intact).decode()
    for damaged in (
        intact[: len(intact) // 2],  # cut in half
        gzip.compress(rows[: len(rows) // 2].encode()),  # cut, then re-packed
        gzip.compress(rows.rsplit("\n", 2)[0].encode() + b"\n"),
    ):  # whole lines dropped
        record.write_bytes(damaged)
        for argv in ([study, "--analyse-only"], [study]):
            assert study_main(argv) == 2
            err = capsys.readouterr().err
            assert "damaged record(s): " in err and str(record) in err and "the other 3 records are intact" in err
    record.write_bytes(intact)
    (results / "plan.json").write_text(plan_text[:100])
    assert study_main([study, "--analyse-only"]) == 2
    assert f"{results / 'plan.json'} is damaged" in capsys.readouterr().err
    (results / "plan.json").write_text(plan_text)
    Path(study).write_text(declared.replace("arms:", "arms: {"))
    assert study_main([study, "--analyse-only"]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as a study file" in err and "Traceback" not in err
    Path(study).write_text(declared)
    assert study_main([study, "--analyse-only"]) == 0 and (folder / "README.md").read_text() == readme


@pytest.mark.parametrize("arm", ["/tmp/x/abs_arm", "../../../../rel_arm", "a/b", "..", ".hidden", "a b"])
def test_an_arm_name_that_would_write_outside_the_study_is_refused(tmp_path, arm):
    for group in ("arms", "controls"):
        arms = {"b": ["algo=grpo"], "t": ["algo=dr_grpo"]}
        extra = {"controls": {arm: ["reward.shuffle=group"]}, "learning": {}} if group == "controls" else {}
        with pytest.raises(StudyError, match=f"arm name {re.escape(repr(arm))} must be a plain name"):
            write_spec(tmp_path, **({"arms": {**arms, arm: ["algo=rloo"]}} if group == "arms" else extra))


def test_an_arm_written_as_a_string_is_refused_not_split_into_characters(tmp_path):
    with pytest.raises(StudyError, match=r"arms.t must be a list of overrides, e.g. \[algo=grpo\], got 'algo=dr_grpo'"):
        write_spec(tmp_path, arms={"b": ["algo=grpo"], "t": "algo=dr_grpo"})
    with pytest.raises(StudyError, match=r"config must be a list of overrides"):
        write_spec(tmp_path, config="steps=3")


def script(path: Path):
    """A script under experiments/ (no package), imported as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_study_testbed_probe_table_is_the_one_its_readme_shows():
    """experiments/study_testbed/README.md's table comes from the kept probes alone, by one command."""
    folder = REPO / "experiments" / "study_testbed"
    probes = script(folder / "probes.py")
    assert probes.table() in (folder / "README.md").read_text()


def test_the_dense_evaluation_calibration_is_the_one_its_readme_shows_and_thins_to_the_study_s_evaluations():
    """experiments/dynamic_sampling_smollm2/README.md's calibration table comes from the kept
    records by one command, and its sparse line is the study's own area: the trapezoids over the
    evaluations at steps 0, 10 and 20 alone, worked here from one record."""
    folder = REPO / "experiments" / "dynamic_sampling_smollm2"
    dense = script(folder / "calibration" / "dense_eval.py")
    assert dense.table() in (folder / "README.md").read_text()
    with gzip.open(folder / "calibration" / "uniform_seed0.jsonl.gz", "rt") as f:
        acc = {r["step"]: r["eval/accuracy"] for r in map(json.loads, f) if "eval/accuracy" in r}
    assert sorted(acc) == list(range(0, 21, 2))
    by_hand = ((acc[0] + acc[10]) / 2 + (acc[10] + acc[20]) / 2) / 2  # two trapezoids of width 10, over 20 steps
    assert dense.area("uniform", 0, "eval/accuracy", {0, 10, 20}) == pytest.approx(by_hand, abs=1e-12)
    every = [(acc[s] + acc[s + 2]) / 2 for s in range(0, 20, 2)]  # ten trapezoids of width 2
    assert dense.area("uniform", 0, "eval/accuracy", None) == pytest.approx(sum(every) / 10, abs=1e-12)


def test_the_dense_study_s_equal_token_comparison_is_the_one_its_readme_shows():
    """The post-hoc comparison at equal generated tokens comes from the kept records by one command."""
    folder = REPO / "experiments" / "dynamic_sampling_smollm2_dense"
    lines = script(folder / "analysis" / "equal_tokens.py").lines()
    assert "\n".join(lines) in (folder / "README.md").read_text()
    assert "dapo - uniform: -0.037 [-0.048, -0.026]" in lines[1]  # behind at equal tokens, ahead per step


def test_a_carry_over_that_was_not_tested_labels_the_difference_it_shows():
    """The replication cell of a gate that failed shows the primary difference, named as such, not
    beside the gate's words where it read as the gate's number (a token difference as a gain)."""
    studies = script(REPO / "experiments" / "studies.py")
    gate = "the baseline did not learn by the learning margin"
    mine = studies.Result(Verdict("equivalent", "inside the margin", "equivalent"), "equivalent", "b - a: +0.5")
    not_tested = Verdict("not tested", f"{gate}, so the testbed cannot show the claim", gate)
    again = studies.Result(not_tested, f"not tested: {gate}", "b - a: +0.415 [-0.418, +1.248] (n = 8)")
    cell = studies.replicated(mine, again)
    assert cell == f"not tested: {gate}; its primary difference b - a: +0.415 [-0.418, +1.248] (n = 8)"
    limit = stats.paired([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert limit.brief() == "+1.000 in every one of 3 pairs (no spread: p = 0, the t-test's limit, n = 3)"
    assert stats.paired([0.3, 0.4, 0.5], [0.4, 0.52, 0.59]).brief() == "+0.103 [+0.065, +0.141] (n = 3)"


@pytest.mark.slow
def test_the_readme_studies_table_is_the_one_its_script_prints():
    """README.md's studies table comes from the studies' own files, by one command."""
    studies = script(REPO / "experiments" / "studies.py")
    assert studies.readme_table() == studies.table()
    assert "| [rloo_vs_dr_grpo](experiments/rloo_vs_dr_grpo/README.md) |" in studies.table()


def test_a_misspelled_premise_metric_stops_the_study_after_its_pilot(tmp_path):
    """A premise names a metric its arm never logged: the study stops (exit 2) naming it, rather
    than reporting a failed premise."""
    spec = gated(tmp_path, premises=[{"metric": "eval/acuracy", "at_most": 0.35}])
    recs = [*records([0.4] * 3, [0.5] * 3), *(rec("c", s, 0.5) for s in range(3))]
    with pytest.raises(Stopped, match="no pilot run logged eval/acuracy") as stop:
        check_logged(spec, recs)
    assert stop.value.code == 2
    check_logged(gated(tmp_path), recs)  # spelled right: nothing to say


def test_a_declared_first_seed_offsets_every_run_seed_and_the_protocol_says_so(tmp_path):
    """`seeds.first` 7: the study's seed 1 trains with seed=8 (the command its run log starts with), its
    bookkeeping keeps the index; the protocol line names the first run seed; a negative one is refused."""
    from rlkit.analysis.runner import Signals, start
    from rlkit.analysis.verdict import seed_words

    spec = write_spec(tmp_path, seeds={"pilot": 2, "cap": 3, "first": 7})
    run_dir = tmp_path / "runs" / "t" / "seed_1"
    proc = start(spec, "t", 1, run_dir, Signals())
    proc.kill()
    proc.wait()
    command = Path(f"{run_dir}.log").read_text().splitlines()[0]
    assert " seed=8 " in command and "algo=dr_grpo" in command
    assert seed_words(spec, None).startswith("run seeds from 7; pilot 2, cap 3")
    assert not seed_words(write_spec(tmp_path, seeds={"pilot": 2, "cap": 3}), None).startswith("run seeds")
    with pytest.raises(StudyError, match="seeds.first must be >= 0"):
        write_spec(tmp_path, seeds={"pilot": 2, "cap": 3, "first": -1})


def test_a_learning_check_can_read_a_control_when_the_arm_under_test_is_claimed_not_to_learn(tmp_path):
    """`learning.arm`: an arm claimed not to rise over its start (t, gains 0.01, 0.0, 0.02, 0.01 by
    hand: equivalent within 0.05) is gated by a control that must learn (c, gains 0.3-0.4) instead of by
    itself; the same records with the check on t give no verdict. An unknown arm is refused."""
    spec = write_spec(
        tmp_path,
        arms={"t": ["algo=grpo"]},
        baseline="start",
        primary={"metric": "eval/accuracy", "aggregate": "final", "direction": "equal", "smallest_effect": 0.05},
        controls={"c": ["algo=dr_grpo"]},
        sensitivity={"arm": "c", "direction": "higher"},
        learning={"aggregate": "gain:1", "margin": 0.1, "arm": "c"},
    )
    recs = [rec("t", s, v) for s, v in enumerate([0.31, 0.30, 0.32, 0.31])]
    recs += [rec("c", s, v) for s, v in enumerate([0.6, 0.7, 0.65, 0.62])]
    r = analyse(spec, recs, None)
    assert r.learned and r.gates["learning"].lines[0].startswith("c (arm): final minus step 0 eval/accuracy = +0.343")
    assert len(r.gates["learning"].lines) == 1  # the control is the check itself, not beside it
    assert r.verdicts["t"].text.startswith("equivalent")
    assert "- Learning check: c's final minus step 0 eval/accuracy" in report(spec, "s", tmp_path, recs, None)
    on_itself = dataclasses.replace(spec, learning=dataclasses.replace(spec.learning, arm=None))
    assert analyse(on_itself, recs, None).verdicts["t"].text == "not tested"
    with pytest.raises(StudyError, match="learning.arm 'x' is not one of the arms or controls"):
        write_spec(tmp_path, learning={"arm": "x"})


def test_a_seeds_runs_start_longest_first_by_their_arms_recorded_times():
    """Three arms on two jobs: the arm whose recorded runs took longest starts first at each seed, so
    the two short ones share the other slot; seeds stay in order, and arms never run keep their place."""
    records = [
        ({"arm": "a", "seed": 0}, [{"time/step": 10.0}, {"time/step": 10.0, "time/eval": 5.0}]),  # 25 s
        ({"arm": "c", "seed": 0}, [{"time/step": 60.0}]),
        ({"arm": "c", "seed": 1}, [{"time/step": 40.0}]),  # c: 50 s on average
        ({"arm": "b", "seed": 0}, [{"time/step": 30.0}]),
    ]
    todo = [(arm, seed) for seed in (1, 2) for arm in ("a", "b", "c", "d")]
    assert longest_first(todo, records) == [
        ("c", 1),
        ("b", 1),
        ("a", 1),
        ("d", 1),
        ("c", 2),
        ("b", 2),
        ("a", 2),
        ("d", 2),
    ]
    assert longest_first(todo, []) == todo


def test_a_claimed_equality_is_refuted_only_by_a_difference_beyond_its_margin(tmp_path):
    """Claimed: equal within ±0.1. Differences 0.09 + 0.05 z, z = (-1.5, -0.5, 0, 0, 0.5, 1.5) (mean 0,
    sd 1): se = 0.05 / sqrt(6) = 0.0204, so against 0 t = 4.41 on 5 df (p = 0.007), but the difference
    is neither shown inside the margin (TOST's upper test (0.09 - 0.1) / se = -0.49: p = 0.32) nor
    beyond it (2 x P(t > -0.49) > 1: p = 1): inconclusive, not refuted. Shifted to 0.3 it lies beyond
    (t = 9.8 past the margin): refuted. The same in a sequential design at 12 pairs."""
    equal = {"metric": "eval/accuracy", "aggregate": "final", "direction": "equal", "smallest_effect": 0.1}
    spec = write_spec(tmp_path, primary=equal)
    z = [-1.5, -0.5, 0.0, 0.0, 0.5, 1.5]
    near = records([0.3] * 6, [0.3 + 0.09 + 0.05 * x for x in z])
    r = analyse(spec, near, None)
    assert r.diffs["t"].p == pytest.approx(2 * stats.sps.t.sf(0.09 / (0.05 / 6**0.5), 5))
    assert r.diffs["t"].p < 0.01 and r.p_adjusted["t"] == 1.0
    word, why = words(r)
    assert word == "inconclusive (not gated)" and "beyond ±0.1 adjusted p = 1, TOST at ±0.1 adjusted p = 0.32" in why
    far = records([0.3] * 6, [0.3 + 0.3 + 0.05 * x for x in z])
    r = analyse(spec, far, None)
    assert r.p_adjusted["t"] == pytest.approx(2 * stats.sps.t.sf(0.2 / (0.05 / 6**0.5), 5))
    assert words(r)[0] == "refuted (not gated)"
    seq = write_spec(tmp_path, primary=equal, seeds={"pilot": 3, "cap": 12}, sequential={"prior": 1.0})
    assert words(analyse(seq, records([0.3] * 12, [0.3 + 0.09 + 0.05 * x for x in z * 2]), None))[0].startswith(
        "inconclusive"
    )
    assert words(analyse(seq, records([0.3] * 12, [0.3 + 0.3 + 0.05 * x for x in z * 2]), None))[0].startswith(
        "refuted"
    )
