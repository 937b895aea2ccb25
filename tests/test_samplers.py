"""Samplers: uniform order and state, and DAPO dynamic sampling. `make_rollout` is a callback
here that returns real `Rollout` objects with chosen rewards (no model is needed to test which
groups the sampler keeps)."""

import torch
from datasets import Dataset

from helpers import make_rollout
from rlkit.rewards import overlong_penalty
from rlkit.samplers import DynamicSampling, Uniform

DATA = Dataset.from_list([{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)])


def test_uniform_covers_each_epoch_and_resumes_from_its_state():
    s = Uniform(DATA, batch_size=4, seed=3)
    first = [r["answer"] for r in s.next_rows(10)]
    assert sorted(first) == sorted(DATA["answer"])  # one epoch is a permutation
    state = s.state_dict()
    again = Uniform(DATA, batch_size=4, seed=3)
    again.load_state_dict(state)
    assert [r["answer"] for r in s.next_rows(7)] == [r["answer"] for r in again.next_rows(7)]
    assert Uniform(DATA, 4, seed=4).next_rows(10) != Uniform(DATA, 4, seed=3).next_rows(10)


def scripted(batches):
    """A make_rollout that returns the next scripted reward batch (G = 2) for the rows it is given."""
    calls = []

    def make(rows):
        rewards = batches[len(calls)]
        calls.append(rows)
        r = make_rollout(rewards, 2)
        r.rows = [row for row in rows for _ in range(2)]
        return r

    return make, calls


def test_dynamic_sampling_keeps_only_informative_groups():
    make, calls = scripted([[1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1]])
    r, stats = DynamicSampling(DATA, batch_size=3, seed=0, max_gen_batches=5).sample(make)
    assert len(calls) == 2 and stats["sampler/gen_batches"] == 2
    assert r.rewards.tolist() == [0, 1, 1, 0, 0, 1]  # informative groups, in order, trimmed to P = 3
    assert r.rows[2] == calls[1][0] and stats["sampler/kept_frac"] == 3 / 6


def test_dynamic_sampling_stops_at_max_gen_batches_and_trains_on_what_it_kept():
    make, calls = scripted([[1, 1, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    r, stats = DynamicSampling(DATA, batch_size=2, seed=0, max_gen_batches=2).sample(make)
    assert len(calls) == 2 and r.num_groups == 1 and stats["sampler/kept_groups"] == 1


def test_dynamic_sampling_may_keep_nothing():
    make, _ = scripted([[1, 1, 0, 0]])
    r, stats = DynamicSampling(DATA, batch_size=2, seed=0, max_gen_batches=1).sample(make)
    assert r.num_groups == 0 and stats["sampler/kept_groups"] == 0


def test_overlong_penalty_by_hand():
    # budget 10, cache 4: no penalty up to 6 tokens, then -1/4 per token, -1 at 10
    lengths = torch.tensor([3, 6, 7, 9, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0]
