"""Built-in testbed: tokenizer round trip, task rewards and data checks, warm-start cache."""

import random

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from rlkit.models import TinyQwen2, char_tokenizer
from rlkit.refusals import ConfigError
from rlkit.tasks.arithmetic import ALPHABET, Arithmetic, Questions
from rlkit.tasks.base import TaskError


def test_tokenizer_round_trip(tmp_path):
    tok = char_tokenizer(ALPHABET)
    text = "3+14=17;17+5=22;22"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert (
        again(text)["input_ids"] == ids and again.decode(ids + [again.eos_token_id], skip_special_tokens=True) == text
    )
    assert tok.decode(tok("9x")["input_ids"], skip_special_tokens=True) == "9"  # unknown char -> <unk>


def test_questions_ask_the_testbeds_sums_and_score_the_last_integer():
    base, q = Arithmetic(n_train=16, n_eval=4, max_terms=3), Questions(n_train=16, n_eval=4, max_terms=3)
    assert [r["answer"] for r in q.eval] == [r["answer"] for r in base.eval]  # the same sums, the same split
    first = base.eval[0]["prompt"]  # e.g. "3+4+5="
    assert q.eval[0]["prompt"] == "What is " + first.rstrip("=").replace("+", " + ") + "?"
    row = {"prompt": "What is 7 + 7?", "answer": "14"}
    assert q.reward(row, "The answer is 14.") == 1.0 and q.reward(row, "7 + 7 = 14") == 1.0
    assert q.reward(row, "7 + 7 = 12, which is the sum of 7 itself.") == 0.0  # the last integer counts
    assert q.reward(row, "fourteen") == 0.0 and q.reward({"answer": "1400"}, "It is 1,400.") == 1.0
    assert q.demonstration is None  # no warm start for a pretrained model
    with pytest.raises(ConfigError, match="must contain"):
        Questions(question="What is it?")


def test_reward_correct_wrong_malformed():
    t = Arithmetic(n_train=8, n_eval=4)
    row = {"prompt": "3+4+5=", "answer": "12"}
    assert t.reward(row, "12") == 1.0
    assert t.reward(row, "3+4=7;7+5=12;12") == 1.0
    assert t.reward(row, "13") == 0.0
    assert t.reward(row, "3+4=7;7+5=12;") == 0.0  # no final answer
    assert t.reward(row, "+=;;") == 0.0
    assert t.reward(row, "") == 0.0


def test_step_rewards_mark_each_worked_step():
    t = Arithmetic(n_train=8, n_eval=4)
    row = {"prompt": "3+4+5=", "answer": "12"}
    assert t.step_rewards(row, "3+4=8;8+5=13;13") == [(6, 0.0), (13, 1.0), (15, 0.0)]
    assert t.step_rewards(row, "12") == [(2, 1.0)]


def test_splits_are_disjoint_and_seeded():
    a, b = Arithmetic(n_train=200, n_eval=50, seed=7), Arithmetic(n_train=200, n_eval=50, seed=7)
    assert a.train["prompt"] == b.train["prompt"] and a.eval["prompt"] == b.eval["prompt"]
    assert not set(a.train["prompt"]) & set(a.eval["prompt"])
    assert len(set(a.eval["prompt"])) == 50


def test_demonstrations_are_correct_and_vary_in_length():
    t = Arithmetic(n_train=100, n_eval=10, min_terms=3, max_terms=3)
    rng = random.Random(0)
    demos = [(row, t.demonstration(row, rng)) for row in t.train]
    assert all(t.reward(row, d) == 1.0 for row, d in demos)
    assert len({";" in d for _, d in demos}) == 2  # both direct and worked answers


def test_missing_answer_and_empty_split_are_reported():
    t = Arithmetic(n_train=8, n_eval=4)
    t.train = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": None}])
    with pytest.raises(TaskError, match="task.train row 1 .* has no answer"):
        t.check_splits()
    t.train = t.train.select([])
    with pytest.raises(TaskError, match="task.train split is empty"):
        t.check_splits()


def test_reward_that_raises_names_the_row():
    t = Arithmetic(n_train=8, n_eval=4)
    t.reward = lambda row, text: 1.0 if row["prompt"] == "1+1=" else 1 / 0
    with pytest.raises(TaskError, match=r"row 1 \(prompt '2\+2=', completion '4'\): ZeroDivisionError"):
        t.score([{"prompt": "1+1="}, {"prompt": "2+2="}], ["2", "4"])


def test_non_finite_reward_is_an_error():
    t = Arithmetic(n_train=8, n_eval=4)
    t.reward = lambda row, text: float("nan")
    with pytest.raises(TaskError, match="returned nan for row 0"):
        t.score([{"prompt": "1+1="}], ["2"])


def test_tiny_model_size():
    model, tok = TinyQwen2().build(ALPHABET, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 500_000 < n < 5_000_000
    assert model.config.vocab_size == len(tok)
