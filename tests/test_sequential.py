"""Sequential studies: the anytime-valid confidence sequence and p-values equal the reference
package's (savvi), and simulated studies with a look after every seed keep their error rates where
a t-test that peeks does not; a sequential study stops at the first look that settles it, and
raising its cap continues it."""

import gzip
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_study import REPO, records, script, write_spec

from rlkit.analysis import stats
from rlkit.analysis.decision import analyse, settled
from rlkit.analysis.sequential import first_decisive, track
from rlkit.analysis.study import StudyError, declared, earliest_look, overrides
from rlkit.analysis.study_cli import main as study_main
from rlkit.analysis.verdict import report, seed_words

SIM = script(REPO / "experiments" / "sequential_designs" / "simulate.py")  # the simulations docs/sweeps.md shows

ALPHA, LOOKS, STUDIES = 0.05, 50, 2000
MC = 2.58 * math.sqrt(ALPHA * (1 - ALPHA) / STUDIES)  # 99% Monte Carlo error of a rate near alpha


@pytest.fixture(scope="module")
def savvi(tmp_path_factory):
    """savvi 0.3.1 (Lindon et al.'s anytime-valid linear models), fetched from the package index
    without its dependencies (cvxpy and matplotlib serve only parts this test does not import):
    its pure-Python wheels go on sys.path."""
    wheels = tmp_path_factory.mktemp("wheels")
    for req in ("savvi==0.3.1", "py-markdown-table==2.0.0"):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", wheels, req]
        subprocess.run(cmd, check=True)
    sys.path[:0] = [str(w) for w in sorted(wheels.glob("*.whl"))]
    from savvi.linear_regression import LinearRegression

    yield LinearRegression
    sys.path[:] = [p for p in sys.path if not p.startswith(str(wheels))]


@pytest.mark.parametrize(("mean", "sd", "phi"), [(0.3, 1.0, 1.0), (-2.0, 0.5, 0.25), (0.05, 0.1, 4.0)])
def test_the_confidence_sequence_and_p_value_are_the_reference_package_s(savvi, mean, sd, phi):
    """At every look, the running interval and p-value equal savvi's intercept-only regression (its
    recursive least squares starts from a 1e6 prior covariance: agreement to about 1e-6)."""
    d = [float(x) for x in np.random.default_rng(7).normal(mean, sd, 15)]
    ref = savvi(ALPHA, 1, phi=phi)
    for n in range(1, len(d) + 1):
        ref.update(np.array([d[n - 1], 1.0]))
        ref.infer()
        s = track(d[:n], ALPHA, phi)
        assert s.p == pytest.approx(ref.p_value[0], rel=1e-5)
        for ours, theirs in zip(s.interval, ref.conf_int[0]):
            assert ours == pytest.approx(theirs, rel=1e-5) if math.isfinite(theirs) else ours == theirs


def test_under_the_null_the_sequential_test_keeps_alpha_where_a_peeking_t_test_does_not():
    """2,000 simulated studies of Gaussian paired differences with mean 0, a look after every seed up
    to 50: the anytime-valid test rejects in at most alpha (+ Monte Carlo error), the t-test that
    peeks at every look in several times alpha."""
    sims = np.random.default_rng(0).normal(0.0, 1.0, (STUDIES, LOOKS))
    sequential = np.mean([SIM.first_rejection(list(map(float, d))) is not None for d in sims])
    peeking = np.mean([SIM.peeking_t_rejects(d) for d in sims])
    assert sequential <= ALPHA + MC
    assert peeking > 3 * ALPHA


@pytest.mark.parametrize(("effect", "oracle_n"), [(1.0, 10), (0.8, 15)])
def test_at_the_smallest_effect_it_stops_before_the_fixed_design_s_planned_n(effect, oracle_n):
    """A true effect of the smallest size (in sd of the differences): the sequential study stops, on
    average, before the n that rlkit's fixed design plans from its pilot, and it detects the effect
    more often than the fixed design's power of 0.8. (With the true sd known in advance the fixed
    n, `oracle_n`, is smaller than the sequential mean: the price of not knowing the spread.)"""
    n_stop, power, planned = SIM.stopping(effect, 500, seed=1)
    assert stats.seeds_for_power(effect, 1.0, True, 0.8, ALPHA) == oracle_n
    assert n_stop.mean() < planned.mean()
    assert power > 0.8
    assert oracle_n < n_stop.mean() < np.percentile(n_stop, 90) <= LOOKS


@pytest.mark.slow
def test_the_sweeps_page_shows_what_the_simulation_script_prints(capsys):
    SIM.main()
    page = " ".join((REPO / "docs" / "sweeps.md").read_text().split())
    null, *table = capsys.readouterr().out.splitlines()
    rates = re.search(r"rejects ([0-9.]+), peeking t-test ([0-9.]+)", null).groups()
    assert f"rejects in {rates[0]} of 2,000 studies, a t-test that peeks at every look in {rates[1]}" in page
    assert all(row in page for row in table)


def test_equivalence_and_the_gates_keep_their_error_rates_at_any_look():
    """A true difference exactly at the equivalence margin: the sequence is shown inside the margin
    at some look in at most alpha of 2,000 studies; a true difference of 0 is shown inside a margin
    of one sd in most. The learning check (the gains' sequence above its margin) with true gains at
    the margin passes at some look in at most alpha."""
    rng = np.random.default_rng(2)
    at_margin = [track(list(map(float, rng.normal(1.0, 1.0, LOOKS))), ALPHA, margin=1.0) for _ in range(STUDIES)]
    assert np.mean([s.p_inside < ALPHA for s in at_margin]) <= ALPHA + MC
    null = [track(list(map(float, rng.normal(0.0, 1.0, LOOKS))), ALPHA, margin=1.0) for _ in range(200)]
    assert np.mean([s.p_inside < ALPHA for s in null]) > 0.8
    gains = [track(list(map(float, rng.normal(0.05, 0.1, LOOKS))), ALPHA) for _ in range(STUDIES)]
    assert np.mean([s.interval[0] > 0.05 for s in gains]) <= ALPHA + MC


def test_the_running_interval_only_narrows_and_covers_the_mean_without_spread():
    s = track([0.2, 0.2, 0.2, 0.2], ALPHA, margin=0.1)
    assert s.interval == (0.2, 0.2) and s.p == 0.0 and s.p_inside == 1.0
    d = [float(x) for x in np.random.default_rng(3).normal(0.0, 1.0, 30)]
    widths = [track(d[:n], ALPHA).interval for n in range(3, 31)]
    assert all(a[0] <= b[0] and b[1] <= a[1] for a, b in zip(widths, widths[1:]))


def test_no_look_before_the_first_decisive_one_can_reject_however_large_the_effect():
    """E_n is at most (1 + n / phi)^((n - 2) / 2): at phi 1, 6^1.5 = 14.7 < 20 at 5 pairs and 7^2 = 49 at 6;
    at phi 0.25, 17 at 4 pairs and 21^1.5 = 96 at 5. Differences of +10 with a little spread reach the
    bound's p-value (1 / E) at those counts."""
    assert first_decisive(0.05, 1.0) == 6 and first_decisive(0.05, 0.25) == 5
    assert first_decisive(0.025, 1.0) == 6 and first_decisive(0.05, 4.0) == 8  # 9^3 = 729 >= 40; 12^3 = 1728 >= 20
    assert first_decisive(0.05, 1.0, most=5) is None
    huge = [10.0 + 0.01 * i for i in range(6)]
    assert track(huge[:5], ALPHA, 1.0).p == pytest.approx(6**-1.5, rel=1e-3) and track(huge, ALPHA, 1.0).p < ALPHA
    assert track(huge[:4], ALPHA, 0.25).p == pytest.approx(1 / 17, rel=1e-3) and track(huge[:5], ALPHA, 0.25).p < ALPHA


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 8.0), st.floats(0.001, 0.2))
def test_first_decisive_is_the_look_where_an_overwhelming_effect_first_rejects(phi, alpha):
    """Differences of 1e6 with a spread of 1e-3 (t about 1e9) put E_n at its limit: the sequence's
    p-value stays above alpha before `first_decisive` pairs and reaches it there."""
    n = first_decisive(alpha, phi, 200)
    d = [1e6 + 1e-3 * i for i in range(n)]
    assert track(d, alpha, phi).p <= alpha * (1 + 1e-6)
    assert n == 3 or track(d[:-1], alpha, phi).p > alpha


def test_a_sequential_cap_that_cannot_reject_is_refused_and_the_protocol_says_when_one_can(tmp_path):
    with pytest.raises(StudyError, match=r"seeds.cap=5: at sequential.prior=1 no look up to the cap can reject"):
        sequential_study(tmp_path, cap=5)
    with pytest.raises(StudyError, match=r"alpha 0.05 \(Holm across 2 treatment\(s\)\)"):  # 0.025: 6 pairs too
        sequential_study(tmp_path, cap=5, arms={"b": ["algo=grpo"], "t": ["algo=dr_grpo"], "u": ["algo=rloo"]})
    spec = sequential_study(tmp_path, cap=6)
    assert earliest_look(spec) == 6
    assert "prior 1: no look before 6 seeds can reject" in seed_words(spec, None)
    assert earliest_look(sequential_study(tmp_path, cap=6, prior=0.25)) == 5


def sequential_study(folder, cap=8, prior=1.0, **changes):
    return write_spec(
        folder,
        seeds={"pilot": 3, "cap": cap},
        sequential={"prior": prior},
        primary={"metric": "eval/accuracy", "aggregate": "final", "direction": "higher", "smallest_effect": 0.05},
        **changes,
    )


def test_a_sequential_verdict_uses_the_anytime_valid_tests(tmp_path):
    """Differences of +0.2 +- a little at 8 seeds: reproduced, with the confidence sequence in the
    reason; at 3 seeds not yet settled (the sequence is unbounded until about 6 pairs)."""
    spec = sequential_study(tmp_path)
    treat = [0.5 + 0.2 + 0.01 * (-1) ** s for s in range(8)]
    recs = records([0.5] * 8, treat)
    r = analyse(spec, recs, None)
    assert r.verdicts["t"].word == "reproduced" and "anytime-valid" in r.verdicts["t"].reason
    assert "confidence sequence [" in r.verdicts["t"].reason
    assert settled(spec, r) == "every tested gate passed and every verdict is decided"
    three = [(h, rows) for h, rows in recs if h["seed"] < 3]
    assert settled(spec, analyse(spec, three, None)) is None


def test_an_open_look_of_a_sequential_study_gives_no_verdict_word_and_no_failed_gate(tmp_path):
    """At 3 seeds every sequence is unbounded: the learning check cannot have passed, yet the study
    goes on, so the README shows the look as open and the check as not passed yet (not "FAILED",
    not "not tested"); at its cap the same records give the final words."""
    learning = {"metric": "eval/accuracy", "aggregate": "gain:1", "margin": 0.01}
    recs = records([0.5, 0.52, 0.49], [0.7, 0.71, 0.69])
    text = report(sequential_study(tmp_path, learning=learning), "s", tmp_path, recs, None)
    assert "### Verdict, t against b: open (look at 3 seeds)" in text
    assert "needs its interval above 0.01: not passed yet" in text
    assert "FAILED" not in text and "not tested" not in text
    six = records([0.5, 0.52, 0.49, 0.51, 0.5, 0.48], [0.7, 0.71, 0.69, 0.72, 0.7, 0.69])
    capped = report(sequential_study(tmp_path, cap=6, learning=learning), "s", tmp_path, six, None)
    assert "open (look at" not in capped and "### Verdict, t against b: reproduced" in capped


def write_records(folder, spec, recs):
    from rlkit.analysis.records import record_path

    for head, rows in recs:
        head.update(declared=declared(spec), overrides=overrides(spec, head["arm"]), rows=len(rows))
        path = record_path(folder / "results", head["arm"], head["seed"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress((json.dumps(head) + "\n" + "\n".join(map(json.dumps, rows))).encode()))


def test_a_sequential_study_stops_at_the_first_settled_look_and_an_extension_continues_it(
    tmp_path, monkeypatch, capsys
):
    """Records for 12 seeds are written here and `run_seeds` only notes the seeds asked for (the tiny
    study in test_study trains real runs end to end): the study looks after each seed and stops at
    the first look that settles it, its README saying so. A noisy study runs to its cap, and raising
    the cap in the study file continues it; any other edit is refused."""
    from rlkit.analysis import runner

    asked = []
    monkeypatch.setattr(runner, "run_seeds", lambda spec, name, seeds, *a: asked.append(seeds))
    monkeypatch.chdir(tmp_path)
    clear = tmp_path / "experiments" / "clear"
    clear.mkdir(parents=True)
    spec = sequential_study(clear, cap=12)
    write_records(clear, spec, records([0.5] * 12, [0.7 + 0.01 * (-1) ** s for s in range(12)]))
    assert study_main(["clear"]) == 0
    stop = asked[-1]
    assert asked == list(range(3, stop + 1)) and 3 < stop < 12
    assert f"look at {stop} seeds: every tested gate passed" in capsys.readouterr().err

    noisy = tmp_path / "experiments" / "noisy"
    noisy.mkdir(parents=True)
    spec = sequential_study(noisy, cap=6)
    write_records(noisy, spec, records([0.5] * 8, [0.5, 0.9, 0.2, 0.6, 0.4, 0.7, 0.3, 0.8]))
    asked.clear()
    assert study_main(["noisy"]) == 0 and asked == [3, 4, 5, 6]
    sequential_study(noisy, cap=8)  # the extension
    asked.clear()
    assert study_main(["noisy"]) == 0 and asked == [3, 4, 5, 6, 7, 8]
    sequential_study(noisy, cap=8, alpha=0.1)
    assert study_main(["noisy"]) == 2
    assert "alpha: 0.05 -> 0.1" in capsys.readouterr().err


def test_a_premise_whose_sequence_misses_its_bound_stops_a_sequential_study(tmp_path):
    """The baseline's mean of its last 2 train/len per run, declared >= 20, is 10 +- 1 at every seed:
    at 3 seeds the sequence is unbounded, so the study looks again; at 8 it lies wholly under 20, so
    the study stops there, naming the premise. At 20 +- 1 it never stops on the premise. A premise on
    values without spread (a start value) is decided at once."""
    premise = {"metric": "train/len", "aggregate": "last:2", "at_least": 20, "why": "answers grow"}
    spec = sequential_study(tmp_path, premises=[premise])
    short = records([0.5] * 8, [0.5, 0.55, 0.47, 0.52, 0.46, 0.53, 0.5, 0.54])  # undecided at 3 seeds
    for head, rows in short:
        for row in rows[1:]:
            row["train/len"] = 10.0 + (-1) ** head["seed"]
    assert settled(spec, analyse(spec, [(h, r) for h, r in short if h["seed"] < 3], None)) is None
    why = settled(spec, analyse(spec, short, None))
    assert why.startswith("a premise cannot hold: answers grow (its sequence [") and why.endswith("needs >= 20)")
    for head, rows in short:
        for row in rows[1:]:
            row["train/len"] += 10.0
    assert "premise" not in (settled(spec, analyse(spec, short, None)) or "")
    start = sequential_study(tmp_path, premises=[{"metric": "eval/accuracy", "aggregate": "start", "at_most": 0.2}])
    first3 = [(h, r) for h, r in short if h["seed"] < 3]
    assert settled(start, analyse(start, first3, None)).startswith("a premise cannot hold: eval/accuracy")
