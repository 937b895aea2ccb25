"""Statistics of rlkit-compare against hand-worked numbers and scipy's own tests; the --baseline,
--x and --smooth options end to end on run directories written by the test."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.image import imread
from scipy import stats as sps

from rlkit.analysis.compare import main as compare_main
from rlkit.analysis.compare import smoothed
from rlkit.analysis.runs import RunHistory, aggregate, x_of
from rlkit.analysis.stats import (
    compare,
    effect_size,
    holm,
    inflated_sd,
    paired,
    robust,
    seeds_for_equivalence,
    seeds_for_power,
    welch,
)


def test_paired_difference_by_hand_and_against_scipy():
    # differences (1, 2, 0): mean 1, sample var 1, se sqrt(1/3) = 0.57735, t(2) quantile 4.3027 -> ± 2.4841
    d = paired([1.0, 2.0, 3.0], [2.0, 4.0, 3.0])
    assert (d.diff, d.df, d.paired) == (1.0, 2, True) and d.half_ci == pytest.approx(4.302653 * 0.577350, rel=1e-5)
    assert d.p == pytest.approx(sps.ttest_rel([2, 4, 3], [1, 2, 3]).pvalue, rel=1e-9)


def test_welch_difference_by_hand_and_against_scipy():
    # a: mean 2.5, var 5/3; b: mean 4, var 4; se^2 = 5/12 + 4/3 = 1.75; df = 1.75^2 / ((5/12)^2/3 + (4/3)^2/2) = 3.2347
    d = welch([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0])
    assert d.diff == 1.5 and d.df == pytest.approx(3.234719, rel=1e-6) and not d.paired
    assert d.half_ci == pytest.approx(sps.t.ppf(0.975, d.df) * math.sqrt(1.75), rel=1e-9)
    assert d.p == pytest.approx(sps.ttest_ind([2, 4, 6], [1, 2, 3, 4], equal_var=False).pvalue, rel=1e-9)


def test_seeds_for_power_match_the_standard_tables():
    # two-sided alpha 0.05, power 0.8: effect size 1 needs 10 pairs or 17 per group; 0.5 needs 64 per group
    assert seeds_for_power(1.0, 1.0, paired=True) == 10
    assert seeds_for_power(1.0, 1.0, paired=False) == 17
    assert seeds_for_power(0.5, 1.0, paired=False) == 64
    assert seeds_for_power(0.0, 1.0, paired=True) is None


def test_seeds_for_power_and_equivalence_do_not_turn_on_scipy_s_nan_far_in_a_tail():
    """A pilot whose spread is small beside the effect: scipy's noncentral t cdf is nan far in its
    lower tail (here at 3 and 4 pairs), which once read as "not enough power" and planned more
    seeds than needed. By hand: d = 0.03 / 0.004 = 7.5; at 2 pairs the power is 0.595 (t_crit
    12.71 on 1 df), at 3 pairs 0.9997 (t_crit 4.30, noncentrality 13.0)."""
    assert seeds_for_power(0.03, 0.004, paired=True) == 3
    assert seeds_for_power(0.02, 0.004, paired=True) == 3
    assert seeds_for_equivalence(0.05, 0.001) == 2


@settings(max_examples=40, deadline=None)
@given(sd=st.floats(0.001, 1.0), ratios=st.lists(st.floats(0.3, 60.0), min_size=2, max_size=2))
def test_a_larger_effect_never_needs_more_seeds(sd, ratios):
    small, large = sorted(ratios)
    for paired_ in (True, False):
        assert seeds_for_power(large * sd, sd, paired_) <= seeds_for_power(small * sd, sd, paired_)
    assert seeds_for_equivalence(large * sd, sd) <= seeds_for_equivalence(small * sd, sd)


def test_runs_are_paired_only_when_both_groups_hold_the_same_seeds():
    assert compare([(0, 1.0), (1, 2.0)], [(1, 2.5), (0, 1.5)]).paired  # matched by seed, not by order
    assert compare([(1, 2.5), (0, 1.5)], [(0, 1.0), (1, 2.0)]).diff == pytest.approx(-0.5)
    assert not compare([(0, 1.0), (1, 2.0)], [(0, 1.5), (2, 2.5)]).paired
    assert "(paired t, n = 3)" in paired([1, 2, 3], [2, 4, 3]).describe()


def test_a_difference_without_spread_is_the_t_tests_limit():
    d = paired([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert d.p == 0 and d.zero_variance and d.interval == (1.0, 1.0)
    assert d.describe() == "+1.000 in every one of 3 pairs (no spread: p = 0, the t-test's limit, n = 3)"
    assert paired([0.3, 0.4], [0.3, 0.4]).p == 1  # no difference at all
    assert paired([0.6, 0.7], [0.7, 0.8]).p == 0  # 0.1 twice, to float rounding
    # the stronger, more consistent result is never the weaker evidence (once "no spread: no test")
    assert paired([0.0156] * 3, [1.0] * 3).p < paired([0.0156] * 3, [0.9, 1.0, 0.95]).p
    assert holm([d.p, 0.01]) == [0.0, 0.01]  # 2 x 0, then 1 x 0.01
    assert math.isnan(paired([1.0], [2.0]).p)  # one pair: no test
    assert holm([float("nan"), 0.01]) == [pytest.approx(float("nan"), nan_ok=True), 0.02]  # untested, in the family
    adjusted = holm([0.02, float("nan"), 0.03])  # m = 3: 3 x 0.02, then max(0.06, 2 x 0.03)
    assert adjusted[0] == pytest.approx(0.06) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.06)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-1000, 1000).map(lambda i: i / 1000), min_size=2, max_size=12),  # metric-like values
    st.integers(0, 2000).map(lambda i: i / 1000),
    st.integers(0, 100).map(lambda i: i / 100),
)
def test_a_dominated_result_never_gets_a_smaller_p(diffs, shift, shrink):
    """Differences moved further from zero (`shift`) and drawn closer to their mean (`shrink`): a
    larger, more consistent effect, whose p is never larger than the original's (shrink 0: no
    spread at all)."""
    mean = sum(diffs) / len(diffs)
    sign = 1.0 if mean >= 0 else -1.0
    stronger = [mean + sign * shift + shrink * (x - mean) for x in diffs]
    zeros = [0.0] * len(diffs)
    weak, strong = paired(zeros, diffs).p, paired(zeros, stronger).p
    assert strong <= weak * (1 + 1e-9) + 1e-12  # float rounding of the moved values


def test_holm_by_hand_and_against_statsmodels():
    # sorted 0.01, 0.03, 0.04, 0.5 times 4, 3, 2, 1 -> 0.04, 0.09, 0.08 (raised to 0.09), 0.5
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    from statsmodels.stats import multitest  # in the dev extra: the test never skips

    ps = [0.001, 0.2, 0.012, 0.049, 0.03, 0.6]
    assert holm(ps) == pytest.approx(list(multitest.multipletests(ps, method="holm")[1]))


def test_tost_by_hand_and_against_statsmodels():
    # differences (0.1, 0.2, 0.0): mean 0.1, se 0.1/sqrt(3); margin 0.3 -> p = P(t_2 < (0.1 - 0.3) / se)
    d = paired([0.0, 0.0, 0.0], [0.1, 0.2, 0.0])
    se = 0.1 / math.sqrt(3)
    assert d.tost(0.3) == pytest.approx(sps.t.cdf(-0.2 / se, 2), rel=1e-9) and d.tost(0.05) > 0.5
    import numpy as np
    from statsmodels.stats import weightstats

    a, b = np.array([0.31, 0.28, 0.35, 0.30, 0.33]), np.array([0.30, 0.31, 0.34, 0.29, 0.35])
    assert paired(list(a), list(b)).tost(0.03) == pytest.approx(
        weightstats.ttost_paired(b, a, -0.03, 0.03)[0], rel=1e-9
    )


def test_effect_size_interval_inverts_the_noncentral_t_and_is_near_the_normal_approximation():
    d, lo, hi = effect_size(1.0, 1.0, 10, paired=True)
    assert d == 1.0 and sps.nct.cdf(1.0 * math.sqrt(10), 9, lo * math.sqrt(10)) == pytest.approx(0.975, abs=1e-9)
    assert sps.nct.cdf(1.0 * math.sqrt(10), 9, hi * math.sqrt(10)) == pytest.approx(0.025, abs=1e-9)
    half = 1.96 * math.sqrt(1 / 10 + 1 / 20)  # se of d_z ~ sqrt(1/n + d^2 / 2n)
    assert lo == pytest.approx(1 - half, abs=0.05) and hi == pytest.approx(1 + half, abs=0.05)


def test_effect_size_interval_of_two_pairs_far_from_zero_is_found():
    """Two pairs whose difference is 30 sd: t = 42.4 on 1 degree of freedom, whose tails are so heavy
    that the interval for the noncentrality reaches past t +- (10 + t)."""
    d, lo, hi = effect_size(30.0, 1.0, 2, paired=True)
    t = 30 * math.sqrt(2)
    assert sps.nct.cdf(t, 1, lo * math.sqrt(2)) == pytest.approx(0.975, abs=1e-6)
    assert sps.nct.cdf(t, 1, hi * math.sqrt(2)) == pytest.approx(0.025, abs=1e-6)
    assert d == 30.0 and lo < 30.0 and hi * math.sqrt(2) > t + 10 + t


def test_pilot_spread_is_inflated_and_equivalence_seeds_reach_their_power():
    # upper 80% limit of an sd from 5 values: sqrt(4 / chi2_0.2(4)) = sqrt(4 / 1.64878) = 1.55757
    assert inflated_sd(1.0, 5) == pytest.approx(1.55757, abs=1e-4)
    import numpy as np

    n = seeds_for_equivalence(1.0, 1.0)
    rng = np.random.default_rng(0)
    hits = [paired([0.0] * n, list(rng.normal(0, 1, n))).tost(1.0) < 0.05 for _ in range(2000)]
    assert np.mean(hits) >= 0.78  # TOST at the planned n shows equivalence at least 80% of the time
    short = [paired([0.0] * (n - 2), list(rng.normal(0, 1, n - 2))).tost(1.0) < 0.05 for _ in range(2000)]
    assert np.mean(short) < np.mean(hits)


@pytest.mark.slow
def test_iqm_and_probability_of_improvement_by_hand():
    a, b = [float(v) for v in range(12)], [float(v) + 20 for v in range(12)]
    assert robust(a[:9], b[:9]) is None  # under 10 runs per arm: the t-test lines only
    r = robust(a, b)
    assert r.iqm_a[0] == pytest.approx(5.5) and r.iqm_b[0] == pytest.approx(25.5)  # mean of the middle six
    assert r.iqm_a[1] <= 5.5 <= r.iqm_a[2] and r.p_improve[0] == 1.0  # every run of b beats every run of a
    assert robust(a, b, lower=True).p_improve[0] == 0.0 and robust(a, b) == r  # fixed random state
    half = robust(a, a)
    assert half.p_improve[0] == 0.5 and half.p_improve[1] < 0.5 < half.p_improve[2]
    # b a hair above a at every seed, seeds far apart: resampling the pairs together keeps each seed's two
    # runs in the same resample, so the interval of P(b > a) is narrower than with the arms resampled apart
    b = [v + 0.5 for v in a]
    together, apart = robust(a, b, paired=True).p_improve, robust(a, b).p_improve
    assert together[0] == apart[0] and together[2] - together[1] < (apart[2] - apart[1]) / 2


def test_per_run_aggregates_by_hand():
    run = RunHistory("r", {}, {"m": [(0, 0.5), (10, 0.2), (20, 0.4), (30, 0.1)]})
    assert aggregate(run, "m", "final") == 0.1 and aggregate(run, "m", "last:2") == pytest.approx(0.25)
    assert aggregate(run, "m", "best") == 0.4 and aggregate(run, "m", "best", lower=True) == 0.1  # step 0 not counted
    # trapezoids over 30 steps: (0.7 + 0.6 + 0.5) * 10 / 2 = 9 -> 0.3
    assert aggregate(run, "m", "auc") == pytest.approx(0.3) and aggregate(run, "other", "final") is None
    # over generated tokens, 100 at step 10 and 300 at steps 20 and 30: the curve at 0, 100, 400 and 700 tokens
    run.history["train/gen_tokens"] = [(10, 100.0), (20, 300.0), (30, 300.0)]
    assert aggregate(run, "m", "auc:tokens:400") == pytest.approx((35 + 90) / 400)  # (0.7 * 100 + 0.6 * 300) / 2
    # cut at 250 tokens, where the curve is 0.2 + 0.2 * 150 / 300 = 0.3: (35 + (0.2 + 0.3) * 150 / 2) / 250
    assert aggregate(run, "m", "auc:tokens:250") == pytest.approx((35 + 37.5) / 250)
    assert aggregate(run, "m", "auc:tokens:701") is None  # the run never generated 701 tokens
    # the same curve reached with three times the tokens: over a common budget it scores less (once the same)
    rising = [(0, 0.2), (10, 0.4), (20, 0.6), (30, 0.8)]
    fast = RunHistory("f", {}, {"m": rising, "train/gen_tokens": [(10, 100.0), (20, 100.0), (30, 100.0)]})
    slow = RunHistory("s", {}, {"m": rising, "train/gen_tokens": [(10, 300.0), (20, 300.0), (30, 300.0)]})
    assert aggregate(fast, "m", "auc:tokens:300") == pytest.approx(0.5)  # the whole curve: (0.3 + 0.5 + 0.7) / 3
    assert aggregate(slow, "m", "auc:tokens:300") == pytest.approx(0.3)  # its first 300 tokens: 0.2 -> 0.4
    with pytest.raises(ValueError, match="'auc:tokens' is withdrawn: it divided each run's area by that run's own"):
        aggregate(run, "m", "auc:tokens")
    for bad in ("auc:tokens:0", "auc:time", "reach:nan:tokens", "reach:inf"):
        with pytest.raises(ValueError, match="use final, last:K"):
            aggregate(run, "m", bad)
    assert aggregate(run, "m", "gain") == pytest.approx(0.1 - 0.5)  # the last value minus step 0's
    assert aggregate(RunHistory("r", {}, {"m": [(5, 0.5), (10, 0.2)]}), "m", "gain") is None  # no step-0 value
    with pytest.raises(ValueError, match="use final, last:K"):
        aggregate(run, "m", "last:0")


def test_smoothing_and_token_axis():
    assert smoothed([(0, 1.0), (1, 3.0), (2, 5.0)], 2) == [(0, 1.0), (1, 2.0), (2, 4.0)]
    run = RunHistory("r", {}, {"train/gen_tokens": [(1, 100.0), (2, 50.0)], "eval/accuracy": [(0, 0.1), (2, 0.3)]})
    assert x_of(run, "tokens") == {0: 0.0, 1: 100.0, 2: 150.0} and x_of(run, "step")[2] == 2.0


def write_run(root, name, algo, seed, acc, tokens, finished=True, config=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"choices": {"algo": algo}, "config": {"seed": seed, **(config or {})}}))
    rows = [{"step": s, "eval/accuracy": a, "train/gen_tokens": tokens, "time/step": 1.0} for s, a in enumerate(acc)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (d / "summary.json").write_text(json.dumps({"wall_s": 3.0}))


def test_compare_with_a_baseline_writes_paired_lines_with_holm_and_plots_against_tokens(tmp_path, capsys):
    finals = {"grpo": [0.5, 0.6, 0.7], "rloo": [0.6, 0.8, 0.7], "dapo": [0.5, 0.6, 0.6], "ppo": [0.1, 0.2, 0.3]}
    for algo, values in finals.items():
        for seed, v in enumerate(values):
            write_run(tmp_path, f"{algo}{seed}", algo, seed, [0.3, (0.3 + v) / 2, v], 100 * (1 + (algo == "dapo")))
    assert (
        compare_main(
            [str(tmp_path), "--by", "algo", "--baseline", "grpo", "--x", "tokens", "--smooth", "2", "--margin", "0.2"]
        )
        == 0
    )
    md = (tmp_path / "compare" / "compare.md").read_text()
    # rloo - grpo final: differences (0.1, 0.2, 0.0) -> +0.100, half-width 4.3027 * 0.1 / sqrt(3) = 0.248
    p = sps.ttest_rel([0.6, 0.8, 0.7], [0.5, 0.6, 0.7]).pvalue
    line = next(l for l in md.splitlines() if l.startswith("- final eval/accuracy: rloo - grpo"))
    assert "+0.100 [-0.148, +0.348], d_z = +1.00 [" in line and f"p = {p:.2g} (paired t, n = 3)" in line
    # six lines (final and best for three groups); ppo's final differences (-0.4 each) have no spread: p = 0,
    # the t-test's limit, first in Holm's order; ppo's best (-0.3, -0.35, -0.4) has the next p, multiplied by 5
    assert "final eval/accuracy: ppo - grpo: -0.400 in every one of 3 pairs (no spread: p = 0, the t-test's" in md
    p_best = sps.ttest_rel([0.2, 0.25, 0.3], [0.5, 0.6, 0.7]).pvalue
    assert f"p = {p_best:.2g} (paired t, n = 3); Holm-adjusted p = {5 * p_best:.2g} over 6 lines" in md
    assert "not shown equivalent within ±0.2 (TOST p = " in line
    png = tmp_path / "compare" / "eval_accuracy_by_tokens.png"
    assert imread(png).shape[1] > imread(png).shape[0]  # four groups: a panel each, side by side
    with pytest.raises(SystemExit):
        compare_main([str(tmp_path), "--by", "algo", "--baseline", "nope"])
    assert "--baseline 'nope' is not a group" in capsys.readouterr().err


def test_best_leaves_out_step_zero(tmp_path):
    for seed in range(2):  # a run that only degrades: its best is its best after training started
        write_run(tmp_path, f"g{seed}", "grpo", seed, [0.5, 0.2 + seed / 10, 0.1], 1)
    compare_main([str(tmp_path), "--by", "algo"])
    assert "| grpo | 2 | 0.100 ± 0.000 | 0.250 ± 0.635 |" in (tmp_path / "compare" / "compare.md").read_text()


def test_what_compare_cannot_use_is_said_never_silently_dropped(tmp_path, capsys):
    write_run(tmp_path, "g0", "grpo", 0, [0.3, 0.4, 0.5], 1)
    write_run(tmp_path, "g1", "grpo", 1, [0.3, 0.6, "nan"], 1)  # a NaN at its last step
    write_run(tmp_path, "g2", "grpo", 2, [0.3, 0.2], 1, finished=False)  # stopped early (exit 3: no summary)
    write_run(tmp_path, "g3", "grpo", 3, [0.3, 0.5, 0.7], 1, config={"steps": 4})  # another config
    compare_main([str(tmp_path), "--by", "algo"])
    err = capsys.readouterr().err
    assert (
        "run g1 logged eval/accuracy as nan or inf at steps [2]; those steps are left out of its final "
        "(its last finite value is from step 1)" in err
    )
    assert "run g2 stopped at step 1 of ? (no summary.json); left out" in err
    assert "group grpo averages runs whose other config keys differ: steps (4, null)" in err
    assert "| grpo | 3 | 0.600 ± 0.248 |" in (tmp_path / "compare" / "compare.md").read_text()  # 0.5, 0.6, 0.7
    compare_main([str(tmp_path), "--by", "algo", "--include-unfinished"])  # 0.5, 0.6, 0.2, 0.7
    assert "| grpo | 4 | 0.500 ± 0.344 |" in (tmp_path / "compare" / "compare.md").read_text()
    (tmp_path / "g4").mkdir()  # a run that never logged the metric: counted as missing, not as 0
    (tmp_path / "g4" / "run.json").write_text(json.dumps({"choices": {"algo": "grpo"}, "config": {"seed": 4}}))
    (tmp_path / "g4" / "metrics.jsonl").write_text('{"step": 0, "train/reward": 0.5}\n')
    (tmp_path / "g4" / "summary.json").write_text("{}")
    compare_main([str(tmp_path), "--by", "algo"])
    assert "| grpo | 4 | 0.600 ± 0.248 (1 of 4 runs without it) |" in (tmp_path / "compare" / "compare.md").read_text()
    with pytest.raises(SystemExit):
        compare_main([str(tmp_path), "--metric", "train/nothing"])
    assert "--metric train/nothing: no run logged it" in capsys.readouterr().err
    assert not (tmp_path / "compare" / "train_nothing.png").exists()


def test_compare_reports_a_metric_one_arm_never_logged_as_missing_and_bad_arguments_exit_2(tmp_path, capsys):
    for engine in ("kv_cache", "off_policy"):
        for seed in range(2):
            d = tmp_path / f"{engine}{seed}"
            d.mkdir()
            (d / "run.json").write_text(json.dumps({"choices": {"engine": engine}, "config": {"seed": seed}}))
            extra = {"offpolicy/abs_log_ratio": 0.1 + seed} if engine == "off_policy" else {}
            rows = [{"step": s, "eval/accuracy": 0.1 * s, **extra} for s in range(3)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "summary.json").write_text("{}")
    (tmp_path / "kv_cache1" / "summary.json").unlink()  # unfinished: a warning, which compare.md keeps too
    args = [
        str(tmp_path),
        "--by",
        "engine",
        "--metric",
        "offpolicy/abs_log_ratio",
        "--baseline",
        "kv_cache",
        "--include-unfinished",
    ]
    assert compare_main(args) == 0
    out = capsys.readouterr()
    assert "offpolicy/abs_log_ratio: off_policy - kv_cache: missing (n = 0" in out.out
    md = (tmp_path / "compare" / "compare.md").read_text()
    assert "## Warnings" in md and "run kv_cache1 stopped at step 2" in md and "missing (n = 0" in md
    for bad in (["--baseline", "nope"], ["--by", "no_such_key"]):
        with pytest.raises(SystemExit) as e:
            compare_main([str(tmp_path), "--by", "engine", *bad])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline 'nope' is not a group; groups: kv_cache, off_policy" in err and "has no key 'no_such_key'" in err


def test_compare_refuses_arguments_out_of_range_before_reading_runs(tmp_path, capsys):
    """--alpha outside (0, 1) once hung (the effect size's bracket loop never ended) or printed
    [+inf, -inf]; a negative margin, a nan threshold and a file as --out are refused alike, exit 2."""
    (tmp_path / "a_file").write_text("")
    cases = {
        ("--alpha", "-1"): "--alpha must be in (0, 1), got -1.0",
        ("--alpha", "2"): "--alpha must be in (0, 1), got 2.0",
        ("--alpha", "0"): "--alpha must be in (0, 1), got 0.0",
        ("--margin", "eval/accuracy=-1"): "--margin eval/accuracy=-1: a margin must be a finite number > 0",
        ("--threshold", "nan"): "--threshold must be a finite number, got nan",
        ("--aggregate", "reach:nan:tokens"): "--aggregate: aggregate 'reach:nan:tokens'",
        ("--out", str(tmp_path / "a_file")): "is a file; give a directory for compare.md and the plots",
    }
    for args, message in cases.items():
        with pytest.raises(SystemExit) as stop:
            compare_main([str(tmp_path), *args])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="alpha must be in"):
        effect_size(1.0, 1.0, 3, True, alpha=-1.0)  # a direct call: an error, not a loop without end
