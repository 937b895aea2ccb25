"""pass@k, the graded testbed and `rlkit-calibrate`: the unbiased estimator against its binomial
formula, the testbed's splits and reward on hand-written completions, and the calibration of a
starting policy against what a training run's own step-0 evaluation reports."""

import json
import re
from math import comb

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import FAST, make_cfg
from rlkit.calibrate import main as calibrate
from rlkit.config import check_values
from rlkit.evaluate import pass_at_k
from rlkit.refusals import ConfigError
from rlkit.rewards import Feature
from rlkit.session import run
from rlkit.tasks.arithmetic import Arithmetic
from rlkit.tasks.graded import LEVELS, Graded


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n), st.lists(st.integers(0, n)))))
def test_pass_at_k_is_one_minus_the_binomial_ratio(case):
    n, k, counts = case
    got = pass_at_k(n, torch.tensor(counts, dtype=torch.long), k)  # [E]
    want = [1 - comb(n - c, k) / comb(n, k) for c in counts]
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_pass_at_k_by_hand():
    c = torch.tensor([0, 1, 2, 4])  # right samples of 4
    assert pass_at_k(4, c, 1).tolist() == pytest.approx([0, 0.25, 0.5, 1])  # c / n
    assert pass_at_k(4, c, 2).tolist() == pytest.approx([0, 0.5, 1 - 1 / 6, 1])  # 1 - C(4-c,2)/6
    assert pass_at_k(4, c, 4).tolist() == [0, 1, 1, 1]  # any right one


def key(row: dict) -> tuple:
    """A question up to the order of its operands."""
    op = "*" if "*" in row["expr"] else "+"
    return (op, *sorted(int(t) for t in row["expr"].split(f" {op} ")))


def test_graded_splits_share_no_question_even_reordered_and_every_level_is_drawn_equally():
    task = Graded(n_train=100, n_eval=16)
    held = {key(r) for r in task.eval}
    assert not held & {key(r) for r in task.train}
    assert len(held) == len(task.eval) == 16 * len(LEVELS)  # no two held-out questions are twins either
    for place, name in enumerate(LEVELS, 1):
        rows = [r for r in task.train if r["level"] == name]
        assert len(rows) == 100 and {r["difficulty"] for r in rows} == {place}
        op, tuples = LEVELS[name]
        pool = {t for t in tuples if (op, *sorted(t)) not in held}  # every question not held out, reordered or not
        assert {r["expr"] for r in rows} == {f" {op} ".join(map(str, t)) for t in pool} or len(pool) > 100
        assert len({r["expr"] for r in rows}) == min(100, len(pool))  # each once before any repeats
    assert task.eval[0]["prompt"].startswith(f"What is {task.eval[0]['expr']}?")


def test_graded_train_weights_draw_a_level_more_often_and_leave_the_held_out_questions():
    """`train_weights=[1, 1, 1, 4, 1, 1]`: the 3-term sums get 400 training rows, all distinct, none
    a reordering of a held-out question; every other level and the held-out split are as without."""
    plain, weighted = Graded(), Graded(train_weights=[1, 1, 1, 4, 1, 1])
    assert list(weighted.eval) == list(plain.eval)
    held = {key(r) for r in weighted.eval}
    counts = {name: sum(r["level"] == name for r in weighted.train) for name in LEVELS}
    assert counts == {name: 400 if name == "sum_3" else 100 for name in LEVELS}
    threes = [r["expr"] for r in weighted.train if r["level"] == "sum_3"]
    assert len(set(threes)) == 400 and not held & {key(r) for r in weighted.train}
    others = [r for r in weighted.train if r["level"] != "sum_3"]
    assert others == [r for r in plain.train if r["level"] != "sum_3"]


def test_graded_n_eval_per_level_holds_out_more_of_one_level_and_leaves_the_others():
    plain, more = Graded(), Graded(n_eval=[16, 16, 16, 64, 16, 16])
    held = {name: [r for r in more.eval if r["level"] == name] for name in LEVELS}
    assert {name: len(rows) for name, rows in held.items()} == {n: 64 if n == "sum_3" else 16 for n in LEVELS}
    assert len({key(r) for r in held["sum_3"]}) == 64 and not {key(r) for r in more.eval} & {key(r) for r in more.train}
    assert held["sum_3"][:16] == [r for r in plain.eval if r["level"] == "sum_3"]  # the plain 16 among them
    assert [r for r in more.eval if r["level"] != "sum_3"] == [r for r in plain.eval if r["level"] != "sum_3"]
    assert sum(r["level"] == "sum_3" for r in more.train) == 100


def test_graded_answers_by_hand():
    row = {"answer": "85"}
    assert Graded.reward(None, row, "27 + 58 makes 85, so the answer is 85.") == 1.0
    assert Graded.reward(None, row, "The answer is: **85**\n") == 1.0  # markdown and a colon are fine
    for wrong in (
        "The answer is 27 + 58 = 85.",  # a restated question
        "To add 27 and 58 we get 85",  # no answer sentence
        "The answer is 8",  # a sentence cut by the budget
        "The answer is 85.3.",  # not the integer
        "The answer is 85. No wait, the answer is 84.",  # the last answer counts
        "The answer is 80.",
    ):
        assert Graded.reward(None, row, wrong) == 0.0, wrong
    task = Graded(n_eval=2)
    assert task.reward(task.eval[0], task.demonstration(task.eval[0], None)) == 1.0  # the probe set's answers are right
    assert task.present(row, "27 + 58 = 85") and not task.present(row, "185 or 8.5")
    assert task.features("The answer is 80.") == {"formatted": 1.0} and task.features("80") == {"formatted": 0.0}
    assert Feature("formatted")(row, "The answer is 80.", task) == 1.0  # the format-only control pays for the form
    with pytest.raises(ConfigError, match="no feature 'worked'"):
        Feature("worked")(row, "80", task)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"levels": ["sum_1d", "sum_9d"]}, "must name levels of"),
        ({"levels": ["sum_1d", "sum_1d"]}, "names a level twice"),
        ({"n_eval": 36, "levels": ["product_1d"]}, "36 distinct questions"),
        ({"question": "What is it?"}, "must contain {expr}"),
        ({"n_eval": [16, 16]}, "one per level of task.levels \\(6\\)"),
        ({"n_eval": [16, 16, 16, 0, 16, 16]}, "task.n_eval an integer >= 1"),
        ({"train_weights": [1, 2]}, "one integer >= 1 per level of task.levels \\(6\\)"),
        ({"train_weights": [1, 1, 1, 0, 1, 1]}, "one integer >= 1 per level"),
    ],
)
def test_graded_refuses_bad_arguments(args, message):
    with pytest.raises(ConfigError, match=message):
        Graded(**args)


def test_calibration_agrees_with_a_runs_step_zero_evaluation(fast_cfg, warm_cache, tmp_path, capsys):
    """The calibration's pass@1 and pass@k are those of `eval.samples` at a run's step 0 (the same
    policy, sampling seed and budget); its greedy accuracy is the run's `eval/accuracy`."""
    sizes = ["eval.samples=4", "eval.pass_k=[1,2,4]", "task.n_eval=12"]
    run(fast_cfg(*sizes, "steps=1"), str(tmp_path / "run"))
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    out = tmp_path / "calibration.json"
    assert calibrate([*FAST, f"warm_start.cache_dir={warm_cache}", *sizes, "--samples", "4", "--out", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert levels["all"]["greedy_accuracy"] == first["eval/accuracy"]
    for k in (1, 2, 4):
        assert levels["all"][f"pass@{k}"] == pytest.approx(first[f"eval/pass@{k}"])
        assert levels["d2"][f"pass@{k}"] == pytest.approx(first[f"eval/pass@{k}_d2"])
    assert levels["all"]["pass@1"] == pytest.approx(first["eval/mean@4"])
    a = levels["all"]
    assert a["prompts"] == 12 and a["pass@1"] <= a["pass@2"] <= a["pass@4"]
    assert 0 <= a["no_signal@4"] <= 1 and a["solved_never"] == pytest.approx(1 - a["pass@4"])  # k = n: any right
    assert a["present"] >= a["pass@1"]  # a right answer holds the answer
    assert "| level | prompts | greedy_accuracy |" in capsys.readouterr().out


def test_calibration_runs_a_multi_turn_environments_episodes_as_the_run_evaluates_them(fast_cfg, warm_cache, tmp_path):
    """With a multi-turn environment (the plugin `helpers.Echo`) the calibration samples episodes and
    reports the environment's metrics of them; its greedy accuracy and pass@k are the run's step-0
    ones (on this testbed both are 0: the echoed reply is read as the answer)."""
    echo = ["++environment._target_=helpers.Echo", "++environment.max_turns=3", "rollout.max_new_tokens=24"]
    sizes = [*echo, "eval.samples=4", "eval.pass_k=[1,4]", "task.n_eval=8"]
    run(fast_cfg(*sizes, "steps=1"), str(tmp_path / "run"))
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    out = tmp_path / "calibration.json"
    assert calibrate([*FAST, f"warm_start.cache_dir={warm_cache}", *sizes, "--samples", "4", "--out", str(out)]) == 0
    a = json.loads(out.read_text())["levels"]["all"]
    assert a["greedy_accuracy"] == first["eval/accuracy"]
    assert [a["pass@1"], a["pass@4"]] == pytest.approx([first["eval/pass@1"], first["eval/pass@4"]])
    assert 1 < a["turns"] <= 3  # the sampled episodes' turns: replies came between them


def test_calibration_and_pass_k_refuse_bad_input(tmp_path, capsys):
    out = ["--out", str(tmp_path / "calibration.json")]
    assert calibrate([*FAST, "--samples", "0", *out]) == 2
    assert calibrate([*FAST, "rollout.nonsense=1", *out]) == 2
    assert calibrate([*FAST, "task.min_terms=1", *out]) == 2  # the task refuses its arguments
    assert not list(tmp_path.iterdir())
    assert "--samples must be >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=re.escape("eval.pass_k needs integers in [1, eval.samples=2], got [4, 0]")):
        check_values(make_cfg(["eval.samples=2", "eval.pass_k=[1,4,0]"]))


def test_the_arithmetic_testbed_s_lenient_score_finds_the_sum_in_worked_steps():
    task = Arithmetic(n_train=4, n_eval=2)
    row = {"answer": "22", "prompt": "3+14+5="}
    assert task.present(row, "3+14=17;17+5=22;22") and task.present(row, "3+14=17;17+5=22;21")
    assert not task.present(row, "3+14=17;17+5=122")


def test_an_output_path_that_cannot_be_written_is_refused_before_the_calibration_runs(tmp_path, capsys):
    """`--out` naming a directory (or a file in a folder that cannot be made) is refused at once,
    exit 2, before any model is built: it once failed after the whole calibration had run."""
    import time

    t0 = time.time()
    assert calibrate([*FAST, "--out", str(tmp_path)]) == 2
    assert f"--out: {tmp_path} is a directory; give the path of a file to write" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert calibrate([*FAST, "--out", str(blocker / "cal.json")]) == 2
    assert "--out: directory" in capsys.readouterr().err and time.time() - t0 < 20  # no model was built


def test_sampled_evaluation_of_some_levels_draws_their_samples_and_logs_them_per_level(fast_cfg, tmp_path):
    """`eval.sample_levels=[2]` samples the level-2 prompts only: with coupled draws (each sample's
    uniforms keyed by its prompt and index, whatever the batch) their mean@4 and pass@k equal those
    of the evaluation that samples every prompt, and no overall or other level's sampled value is
    logged; greedy metrics stay whole."""
    sizes = ["task.max_terms=3", "task.n_eval=12", "eval.samples=4", "eval.pass_k=[1,4]", "rollout.coupled=true"]
    first = {}
    for name, extra in (("all", []), ("d2", ["eval.sample_levels=[2]"])):
        run(fast_cfg(*sizes, *extra, "steps=1"), str(tmp_path / name))
        first[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    every, some = first["all"], first["d2"]
    sampled = {k for k in every if k.startswith(("eval/mean@", "eval/pass@"))}
    assert {k for k in some if k.startswith(("eval/mean@", "eval/pass@"))} == {k for k in sampled if k.endswith("_d2")}
    assert {"eval/mean@4", "eval/mean@4_d3", "eval/pass@4_hard"} <= sampled  # what the restricted run leaves out
    for k in ("eval/mean@4_d2", "eval/pass@1_d2", "eval/pass@4_d2"):
        assert some[k] == pytest.approx(every[k])
    assert some["eval/accuracy"] == every["eval/accuracy"] and some["eval/acc_d3"] == every["eval/acc_d3"]


def test_sample_levels_refuse_a_level_the_held_out_split_lacks_and_need_samples(fast_cfg, tmp_path):
    with pytest.raises(ConfigError, match=re.escape("needs eval.samples > 0")):
        check_values(make_cfg(["eval.sample_levels=[2]"]))
    with pytest.raises(ConfigError, match=r"no prompt of difficulty \[9\.0\] \(its levels: 2\)"):
        run(fast_cfg("eval.samples=2", "eval.sample_levels=[2,9]", "steps=1"), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
