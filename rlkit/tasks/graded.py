"""A graded arithmetic testbed for a pretrained chat model: levels of rising difficulty, asked as
questions whose answer format the model is told, and a reward that reads the answer only where
that format puts it.

Prompt ``What is 27 + 58? Finish with the sentence "The answer is <number>."``; the reward is 1
when the last "answer is N" in the completion is followed by the end of the sentence (".", "!" or a
line break; "85.3" is not 85) and N is right. A restated question ("The answer is 27 + 58 = 85."), a truncated
sentence ("The answer is 8") or a number elsewhere earns nothing; the task's lenient score
(`present`: the right number anywhere) and the `formatted` feature (the sentence is there, right or
wrong) tell a gain in format from a gain in skill.
"""

from __future__ import annotations

import itertools
import random
import re

from datasets import Dataset

from rlkit.refusals import require
from rlkit.tasks.base import Task

ANSWER = re.compile(r"answer is\s*:?\s*\**\s*(-?\d+)\s*\**\s*(?:[.!](?!\d)|\n)", re.IGNORECASE)


def _pairs(lo: int, hi: int) -> list[tuple]:
    return list(itertools.product(range(lo, hi + 1), repeat=2))


def _carry(a: int, b: int) -> bool:
    return a % 10 + b % 10 >= 10


# name -> (operator, every operand tuple of the level)

LEVELS = {
    "plus_one": ("+", [(a, 1) for a in range(10, 100)]),  # two digits, so that no question is also sum_1d's
    "sum_1d": ("+", _pairs(0, 9)),
    "product_1d": ("*", _pairs(2, 9)),
    "sum_3": ("+", list(itertools.product(range(1, 10), repeat=3))),
    "sum_2d": ("+", [(a, b) for a, b in _pairs(10, 99) if not _carry(a, b) and a + b < 100]),
    "sum_2d_carry": ("+", [(a, b) for a, b in _pairs(10, 99) if _carry(a, b)]),
}


def draw_levels(
    levels: list[str], n_train: int, n_eval: list[int], seed: int, weights: list[int] | None = None
) -> tuple[list, list]:
    """Per level: its `n_eval` held-out operand tuples, none the reordering of another ("3 + 4" and
    "4 + 3" are one), then `n_train` training rows (times the level's weight, 1 by default) from the
    other tuples, none a reordering of a held-out one, each tuple once before any repeats (a small
    level repeats, so that every level has its rows and a uniform sampler draws the levels in
    proportion to their weights). Rows carry `difficulty` (the level's place in `levels`, from 1)
    and `level`. The held-out rows do not depend on the weights.
    -> (train rows, eval rows)"""
    rng, train, held = random.Random(seed), [], []
    for place, (name, weight, n_held) in enumerate(zip(levels, weights or [1] * len(levels), n_eval), 1):
        op, tuples = LEVELS[name]
        tuples = rng.sample(tuples, len(tuples))
        twins = {}  # canonical (sorted) tuple -> its tuples
        for t in tuples:
            twins.setdefault(tuple(sorted(t)), []).append(t)
        keys = list(twins)
        require(
            len(keys) > n_held,
            f"task level {name!r} has {len(keys)} distinct questions; task.n_eval={n_held} leaves none",
        )
        held += [_row(twins[k][0], op, place, name) for k in keys[:n_held]]
        pool = [_row(t, op, place, name) for k in keys[n_held:] for t in twins[k]]
        train += list(itertools.islice(itertools.cycle(pool), n_train * weight))
    return train, held


def _row(terms: tuple, op: str, difficulty: int, level: str) -> dict:
    value = terms[0] * terms[1] if op == "*" else sum(terms)
    return {"expr": f" {op} ".join(map(str, terms)), "answer": str(value), "difficulty": difficulty, "level": level}


class Graded(Task):
    """Arithmetic questions in `levels` (names of `LEVELS`; a row's `difficulty` is its level's
    place, from 1; how hard each level is for a model is measured, with `rlkit-calibrate`),
    `n_eval` held-out questions (one number, or one per level) and `n_train` training rows per level,
    no question in both splits even reordered. `question` holds `{expr}`. `train_weights` (one
    integer >= 1 per level) gives a level that many times `n_train` rows, so a uniform sampler draws it
    that much more often."""

    def __init__(
        self,
        levels: list[str] = ("plus_one", "sum_1d", "product_1d", "sum_3", "sum_2d", "sum_2d_carry"),
        n_train: int = 100,
        n_eval: int | list[int] = 16,
        question: str = 'What is {expr}? Finish with the sentence "The answer is <number>."',
        seed: int = 1234,
        train_weights: list[int] | None = None,
    ):
        unknown = [name for name in levels if name not in LEVELS]
        require(not unknown and levels, f"task.levels must name levels of {sorted(LEVELS)}, got {list(levels)}")
        require(len(set(levels)) == len(levels), f"task.levels names a level twice: {list(levels)}")
        require("{expr}" in question, f"task.question must contain {{expr}}, got {question!r}")
        per_level = [n_eval] * len(levels) if isinstance(n_eval, int) else list(n_eval)
        require(
            n_train >= 1 and len(per_level) == len(levels) and all(isinstance(n, int) and n >= 1 for n in per_level),
            f"task.n_train must be >= 1 and task.n_eval an integer >= 1 or one per level of task.levels "
            f"({len(levels)}), got {n_train} and {n_eval}",
        )
        weights = None if train_weights is None else list(train_weights)
        require(
            weights is None or (len(weights) == len(levels) and all(isinstance(w, int) and w >= 1 for w in weights)),
            f"task.train_weights needs one integer >= 1 per level of task.levels ({len(levels)}), got {weights}",
        )
        train, held = draw_levels(list(levels), n_train, per_level, seed, weights)
        self.train, self.eval = (
            Dataset.from_list([{**r, "prompt": question.format(expr=r["expr"])} for r in split])
            for split in (train, held)
        )

    def demonstration(self, row: dict, rng: random.Random) -> str:
        """A right answer in the asked format: the probe set of `eval/probe_entropy` (a pretrained
        model's preset has no warm start, so nothing trains on it unless `warm_start.steps` > 0)."""
        return f"The answer is {row['answer']}."

    def reward(self, row: dict, completion: str) -> float:
        said = ANSWER.findall(completion)
        return float(bool(said) and int(said[-1]) == int(row["answer"]))

    @staticmethod
    def features(completion: str) -> dict:
        """`formatted`: the completion ends a sentence "The answer is N." (right or wrong)."""
        return {"formatted": float(ANSWER.search(completion) is not None)}
