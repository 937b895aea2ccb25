"""The wide testbed and metrics split by difficulty and correctness, by hand."""

import pytest
import torch

from conftest import make_cfg
from helpers import make_rollout
from rlkit.advantages import DrGRPO
from rlkit.aggregators import SeqMeanTokenMean
from rlkit.config import build
from rlkit.metrics import feature_metrics, hardest_third, rollout_metrics, weight_metrics
from rlkit.tasks.base import Task
from rlkit.warm_start import train_supervised


def test_wide_testbed_rows_carry_their_number_of_terms_as_difficulty():
    task = build(make_cfg(["task=arithmetic_wide", "task.n_train=300", "task.n_eval=50"]), "task")
    assert {r["difficulty"] for r in task.train} == set(range(2, 9))
    for r in list(task.train)[:50]:
        assert r["difficulty"] == r["prompt"].count("+") + 1 and int(r["answer"]) == sum(task.terms(r))
    worked = task.demonstration({"prompt": "1+2+3+4+5+6+7+8=", "answer": "36"}, __import__("random").Random(0))
    assert worked in ("36", "1+2=3;3+3=6;6+4=10;10+5=15;15+6=21;21+7=28;28+8=36;36")  # long worked answers


def test_hardest_third_is_the_top_third_of_difficulty_levels():
    rows = [{"difficulty": d} for d in (2, 3, 4, 5, 6, 7, 8, 8)]  # 7 levels: the top 3 are 6, 7, 8
    ok = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 1])
    assert hardest_third(rows, ok, "eval/acc") == {"eval/acc_hard": pytest.approx(2 / 4)}
    assert hardest_third([{"difficulty": 2}, {"difficulty": 3}], torch.tensor([0.0, 1.0]), "x") == {"x_hard": 1.0}
    assert hardest_third([{"prompt": "a"}], torch.tensor([1.0]), "x") == {}


def test_the_warm_start_demonstrates_only_prompts_up_to_demo_max_terms(monkeypatch):
    task = build(
        make_cfg(["task=arithmetic_wide", "task.n_train=300", "task.n_eval=50", "task.demo_max_terms=4"]), "task"
    )
    assert {r["difficulty"] for r in task.demonstrations} == {2, 3, 4} and len(task.train) == 300
    seen = []
    monkeypatch.setattr(type(task), "demonstration", lambda self, row, rng: seen.append(row["difficulty"]) or "1")
    tok = build(make_cfg([]), "model").build(task.alphabet, 0)
    train_supervised(*tok, task, steps=2, batch_size=16, lr=1e-3, seed=0)
    assert len(seen) == 32 and max(seen) == 4
    with pytest.raises(Exception, match="demo_max_terms"):
        build(make_cfg(["task=arithmetic_wide", "task.demo_max_terms=9"]), "task")


def rollout_with_difficulty():
    # two groups of 2: difficulty 2 (rewards 1, 0) and difficulty 5 (rewards 0, 0); lengths 1, 3, 2, 2
    r = make_rollout([1.0, 0.0, 0.0, 0.0], G=2, lengths=[1, 3, 2, 2], T=3)
    r.rows = [{"difficulty": 2}] * 2 + [{"difficulty": 5}] * 2
    return r


def test_accuracy_and_length_split_by_difficulty_and_correctness():
    r = rollout_with_difficulty()
    m = rollout_metrics(r, DrGRPO()(r))
    assert (m["train/acc_d2"], m["train/acc_d5"]) == (0.5, 0.0)
    assert (m["train/len_correct"], m["train/len_incorrect"]) == (1.0, pytest.approx(7 / 3))


def test_loss_weight_share_by_difficulty():
    # Dr. GRPO advantages +0.5, -0.5 in the informative group, 0 in the flat one; per-sequence token-mean
    # weights 1/(4 |o|): |A w| summed per row = 0.5/4 each -> the difficulty-2 group holds all the weight
    r = rollout_with_difficulty()
    adv = DrGRPO()(r)
    m = weight_metrics(r, adv, SeqMeanTokenMean().token_weights(r.completion_mask))
    assert (m["weight/share_d2"], m["weight/share_d5"]) == (1.0, 0.0)
    assert m["weight/correct_sum"] == pytest.approx(0.125) and m["weight/incorrect_sum"] == pytest.approx(-0.125)


def test_tasks_without_difficulty_log_no_split():
    r = make_rollout([1.0, 0.0], G=2)
    assert not [k for k in rollout_metrics(r, DrGRPO()(r)) if "_d" in k]


def test_the_share_of_worked_answers_by_difficulty_by_hand():
    task = build(make_cfg(["task=arithmetic_wide", "task.n_train=300", "task.n_eval=50"]), "task")
    rows = [{"difficulty": d} for d in (2, 2, 5, 8, 8)]  # levels 2, 5, 8: the hardest third is level 8
    texts = ["1+2=3;3", "3", "1+2=3;3+4=7;7+1=8;8+0=8;8", "36", "1+2=3;oops"]
    m = feature_metrics(task, rows, texts, "eval", hard=True)
    assert m == {
        "eval/worked": pytest.approx(3 / 5),
        "eval/worked_d2": 0.5,
        "eval/worked_d5": 1.0,
        "eval/worked_d8": 0.5,
        "eval/worked_hard": 0.5,
    }
    assert "train/worked_hard" not in feature_metrics(task, rows, texts, "train")  # a batch's levels vary
    assert feature_metrics(task, rows, [], "eval") == {}
    assert feature_metrics(Task(), rows, texts, "eval") == {}  # a task without features logs none
