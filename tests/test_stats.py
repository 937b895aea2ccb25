"""Statistics of rlkit-compare against hand-worked numbers and scipy's own tests; the --baseline,
--x and --smooth options end to end on run directories written by the test."""
import json
import math

import pytest
from matplotlib.image import imread
from scipy import stats as sps

from rlkit.compare import main as compare_main, smoothed, x_of, Run
from rlkit.stats import compare, paired, seeds_for_power, welch


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


def test_runs_are_paired_only_when_both_groups_hold_the_same_seeds():
    assert compare([(0, 1.0), (1, 2.0)], [(1, 2.5), (0, 1.5)]).paired  # matched by seed, not by order
    assert compare([(1, 2.5), (0, 1.5)], [(0, 1.0), (1, 2.0)]).diff == pytest.approx(-0.5)
    assert not compare([(0, 1.0), (1, 2.0)], [(0, 1.5), (2, 2.5)]).paired
    assert "not significant (paired, n = 3" in paired([1, 2, 3], [2, 4, 3]).verdict("rloo - grpo")


def test_smoothing_and_token_axis():
    assert smoothed([(0, 1.0), (1, 3.0), (2, 5.0)], 2) == [(0, 1.0), (1, 2.0), (2, 4.0)]
    run = Run("r", {}, {"train/gen_tokens": [(1, 100.0), (2, 50.0)], "eval/accuracy": [(0, 0.1), (2, 0.3)]})
    assert x_of(run, "tokens") == {0: 0.0, 1: 100.0, 2: 150.0} and x_of(run, "step")[2] == 2.0


def write_run(root, name, algo, seed, acc, tokens):
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"choices": {"algo": algo}, "config": {"seed": seed}}))
    rows = [{"step": s, "eval/accuracy": a, "train/gen_tokens": tokens, "time/step": 1.0} for s, a in enumerate(acc)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_with_a_baseline_writes_paired_verdicts_and_plots_against_tokens(tmp_path):
    finals = {"grpo": [0.5, 0.6, 0.7], "rloo": [0.6, 0.8, 0.7], "dapo": [0.5, 0.6, 0.6], "ppo": [0.1, 0.2, 0.3]}
    for algo, values in finals.items():
        for seed, v in enumerate(values):
            write_run(tmp_path, f"{algo}{seed}", algo, seed, [0.3, (0.3 + v) / 2, v], 100 * (1 + (algo == "dapo")))
    assert compare_main([str(tmp_path), "--by", "algo", "--baseline", "grpo", "--x", "tokens", "--smooth", "2"]) == 0
    md = (tmp_path / "compare" / "compare.md").read_text()
    # rloo - grpo final: differences (0.1, 0.2, 0.0) -> +0.100 ± 0.248, p = ttest_rel
    p = sps.ttest_rel([0.6, 0.8, 0.7], [0.5, 0.6, 0.7]).pvalue
    assert f"- final eval/accuracy: rloo - grpo: +0.100 ± 0.248, p = {p:.2g}, not significant (paired, n = 3" in md
    assert "final eval/accuracy: ppo - grpo: -0.400 ± 0.000" in md and ", significant (paired" in md
    png = tmp_path / "compare" / "eval_accuracy_by_tokens.png"
    assert imread(png).shape[1] > imread(png).shape[0]  # four groups: a panel each, side by side
    with pytest.raises(SystemExit, match="--baseline 'nope' is not a group"):
        compare_main([str(tmp_path), "--by", "algo", "--baseline", "nope"])
