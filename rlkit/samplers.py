"""Prompt samplers: `sampler.sample(make_rollout) -> (rollout, stats)`, where
`make_rollout(rows)` generates and scores G completions for each dataset row."""
from __future__ import annotations

from typing import Callable

import numpy as np
from datasets import Dataset

from rlkit.rollout import Rollout


class Uniform:
    """P prompts per step from the training split, reshuffled every epoch, seeded; its position
    is part of the checkpoint."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int = 0):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.pos = 0, 0

    def next_rows(self, n: int) -> list[dict]:
        rows = []
        while len(rows) < n:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
            take = order[self.pos:self.pos + n - len(rows)]
            rows.extend(self.dataset[int(i)] for i in take)
            self.pos += len(take)
            if self.pos >= len(self.dataset):
                self.epoch, self.pos = self.epoch + 1, 0
        return rows

    def sample(self, make_rollout: Callable[[list[dict]], Rollout]) -> tuple[Rollout, dict]:
        return make_rollout(self.next_rows(self.batch_size)), {}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
