"""A study's declared compute budget: run-hours from the records (each run's wall time, or its
logged times for a record kept without one), the seeds a fixed design's budget affords, and the
seed before which a sequential study stops; worked by hand on records the test writes (`run_seeds`
only records what it is asked for: the tiny study in test_study trains real runs end to end)."""

import json

import pytest
from test_sequential import sequential_study, write_records
from test_study import rec, records, write_spec

from rlkit.analysis import runner
from rlkit.analysis.budget import exhausted, run_hours, seed_hours, spent
from rlkit.analysis.decision import analyse
from rlkit.analysis.records import plan
from rlkit.analysis.study import StudyError
from rlkit.analysis.study_cli import main as study_main
from rlkit.analysis.verdict import ended


def timed(recs, hours: dict):
    """The records with each arm's runs taking `hours[arm]` of wall time."""
    for head, _ in recs:
        head["wall_s"] = hours[head["arm"]] * 3600
    return recs


def test_a_runs_hours_are_its_wall_time_else_its_logged_step_and_evaluation_times():
    head, rows = rec("b", 0, 0.5)
    for row, (step, ev) in zip(rows, [(0.0, 900.0), (1800.0, 0.0), (1800.0, 900.0)]):
        row.update({"time/step": step, "time/eval": ev})
    assert run_hours(head, rows) == pytest.approx(1.5)  # 5400 s logged
    assert run_hours({**head, "wall_s": 7200.0}, rows) == 2.0
    assert run_hours({**head, "wall_s": None}, rows) == pytest.approx(1.5)  # a run without a summary
    recs = timed(records([0.5, 0.5, 0.5], [0.6, 0.6]), {"b": 1.0, "t": 0.5})
    assert spent(recs) == 4.0 and seed_hours(recs) == 1.5  # one more seed: a run of each arm


def test_a_budget_that_is_not_positive_is_refused(tmp_path):
    with pytest.raises(StudyError, match="budget must be > 0 run-hours, got 0"):
        write_spec(tmp_path, budget=0)


def test_a_fixed_design_plans_no_more_seeds_than_its_budget_affords(tmp_path, monkeypatch, capsys):
    """Pilot: 3 seeds of 2 runs of an hour each, 6 run-hours; a budget of 9 pays for 4 seeds, under
    the cap of 8 and the about 60 the noisy pilot needs: the study stops after its pilot naming the
    budget, and `--to-cap` runs the 4 it affords."""
    folder = tmp_path / "experiments" / "dear"
    folder.mkdir(parents=True)
    spec = write_spec(folder, seeds={"pilot": 3, "cap": 8}, budget=9)
    pilot = timed(records([0.3, 0.4, 0.5], [0.2, 0.6, 0.45]), {"b": 1.0, "t": 1.0})
    p = plan(spec, pilot)
    assert (p.affordable, p.limit, p.seeds, p.capped) == (4, 4, 4, True) and p.needed > 8
    assert plan(write_spec(folder, seeds={"pilot": 3, "cap": 8}), pilot).affordable is None
    spec = write_spec(folder, seeds={"pilot": 3, "cap": 8}, budget=9)
    write_records(folder, spec, pilot)
    asked = []
    monkeypatch.setattr(runner, "run_seeds", lambda spec, name, seeds, *a: asked.append(seeds))
    monkeypatch.chdir(tmp_path)
    assert study_main(["dear"]) == 4 and "past the 4 the budget affords" in capsys.readouterr().err
    assert study_main(["dear", "--to-cap"]) == 0 and asked[-1] == 4
    assert json.loads((folder / "results" / "plan.json").read_text())["affordable"] == 4


def test_a_sequential_study_stops_before_the_seed_its_budget_cannot_pay_and_says_what_deciding_costs(
    tmp_path, monkeypatch, capsys
):
    """Each seed: two runs of an hour. A budget of 13 run-hours pays for the 6th seed (10 + 2 <= 13),
    not the 7th (12 + 2 > 13): a noisy study that no look settles stops after 6 seeds, undecided, its
    README saying so with the seeds and run-hours a fixed-sample test would need. A seed already
    begun is finished whatever the budget; raising the budget continues the study (an extension)."""
    folder = tmp_path / "experiments" / "noisy"
    folder.mkdir(parents=True)
    spec = sequential_study(folder, cap=12, budget=13)
    pool = timed(records([0.5] * 12, [0.5, 0.9, 0.2, 0.6, 0.4, 0.7, 0.3, 0.8, 0.1, 0.6, 0.5, 0.7]), {"b": 1, "t": 1})
    asked = []

    def run_seeds(spec, name, seeds, *a):  # records the asked seeds' runs as if they had trained
        asked.append(seeds)
        write_records(folder, spec, [(h, r) for h, r in pool if h["seed"] < seeds])

    monkeypatch.setattr(runner, "run_seeds", run_seeds)
    monkeypatch.chdir(tmp_path)
    assert study_main(["noisy"]) == 0 and asked == [3, 4, 5, 6]
    err = capsys.readouterr().err
    assert "stopped before seed 6: the declared budget of 13 run-hours is spent (12.00 run-hours recorded" in err
    readme = (folder / "README.md").read_text()
    assert "Stopped at 6 seeds, undecided: the declared budget of 13 run-hours is spent" in readme
    assert "compute: 12.00 run-hours of the declared 13 (about 2.00 a seed of every arm)" in readme
    assert "### Verdict, t against b: inconclusive" in readme
    n = int(readme.split("fixed-sample test would need about ")[1].split(" seeds")[0])
    assert f"about {n} seeds per arm for t ({2 * n:.1f} run-hours in all) to decide." in readme and n > 6
    assert exhausted(spec, [(h, r) for h, r in pool if h["seed"] < 5]) is None
    write_records(folder, spec, [(h, r) for h, r in pool if h["seed"] == 6 and h["arm"] == "b"])  # begun
    asked.clear()
    assert study_main(["noisy"]) == 0 and asked == [3, 4, 5, 6, 7]
    sequential_study(folder, cap=12, budget=17)  # the extension: two seeds more
    asked.clear()
    assert study_main(["noisy"]) == 0 and asked == [3, 4, 5, 6, 7, 8]


def test_a_sequential_budget_that_cannot_reach_the_first_decisive_look_stops_after_the_pilot(
    tmp_path, monkeypatch, capsys
):
    """Two runs of an hour a seed and a budget of 9 run-hours: 4 seeds, but at prior 1 no look
    before 6 pairs can reject, so the study stops after its pilot instead of spending the rest; at
    prior 0.25 (5 pairs) a budget of 10 pays for them."""
    folder = tmp_path / "experiments" / "short"
    folder.mkdir(parents=True)
    sequential_study(folder, cap=12, budget=9)
    pool = timed(records([0.5] * 6, [0.5, 0.9, 0.2, 0.6, 0.4, 0.7]), {"b": 1, "t": 1})
    asked = []

    def run_seeds(spec, name, seeds, *a):
        asked.append(seeds)
        write_records(folder, spec, [(h, r) for h, r in pool if h["seed"] < seeds])

    monkeypatch.setattr(runner, "run_seeds", run_seeds)
    monkeypatch.chdir(tmp_path)
    assert study_main(["short"]) == 0 and asked == [3]
    why = "pays for about 4 seeds at about 2.00 a seed, fewer than the 6 from which a look can reject (prior 1)"
    assert why in capsys.readouterr().err and why in (folder / "README.md").read_text()
    three = [(h, r) for h, r in pool if h["seed"] < 3]
    assert exhausted(sequential_study(tmp_path, cap=12, budget=10, prior=0.25), three) is None
    assert "fewer than the 5" in exhausted(sequential_study(tmp_path, cap=12, budget=9.9, prior=0.25), three)


def test_a_sequential_study_is_over_when_settled_spent_or_capped_and_not_before(tmp_path):
    """`ended` (the README's last-look line, and what lets the studies table give a sequential
    study's verdict): None while the study goes on, a sentence once it reached its cap."""
    recs = timed(records([0.5] * 6, [0.5, 0.9, 0.2, 0.6, 0.4, 0.7]), {"b": 1, "t": 1})

    def last_look(**changes):
        spec = sequential_study(tmp_path, **changes)
        return ended(spec, recs, analyse(spec, recs, None))

    assert last_look(cap=8) is None
    assert last_look(cap=6).startswith("Stopped at the cap of 6 seeds, undecided.")
    assert last_look(cap=8, budget=13).startswith("Stopped at 6 seeds, undecided: the declared budget")  # 12 + 2 > 13
    assert last_look(cap=8, budget=14) is None
