"""Prompt samplers: `sampler.sample(make_rollout) -> (rollout, stats)`, where
`make_rollout(rows)` generates and scores G completions for each dataset row."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from datasets import Dataset

from rlkit import parallel
from rlkit.components import Sampler
from rlkit.refusals import require
from rlkit.tensors import flat
from rlkit.types import Rollout


class Uniform(Sampler):
    """P prompts per step from the training split, reshuffled every epoch, seeded; its position
    is part of the checkpoint."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int = 0):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.pos = 0, 0

    def next_rows(self, n: int) -> list[dict]:
        rows = []
        while len(rows) < n:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
            take = order[self.pos : self.pos + n - len(rows)]
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


def informative_groups(r: Rollout) -> torch.Tensor:
    """Indices of groups whose task rewards are not all equal.  -> [k]"""
    return (~flat(r.rewards.view(-1, r.group_size))[:, 0]).nonzero().squeeze(-1)  # [k]


def first_informative(r: Rollout, k: int) -> tuple[torch.Tensor, int]:
    """This rank's groups among the first k informative groups of the whole batch (every rank's
    groups in rank order, as one process sees them), and how many were kept over all ranks.
    -> [<= k] local group indices, count"""
    shares = parallel.gather((r.num_groups, informative_groups(r).tolist()))  # per rank
    starts = [sum(n for n, _ in shares[:i]) for i in range(len(shares))]
    chosen = [start + g for start, (_, groups) in zip(starts, shares) for g in groups][:k]  # global indices
    mine = starts[parallel.rank()]
    local = [g - mine for g in chosen if mine <= g < mine + r.num_groups]
    return torch.tensor(local, dtype=torch.long), len(chosen)


class DynamicSampling(Uniform):
    """DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476): generate, drop groups whose
    rewards are all equal (accuracy 0 or 1, zero advantage in every group estimator), and
    generate again until P informative groups are kept or `max_gen_batches` batches were used;
    then train on what was kept (possibly fewer than P, possibly none) and report it. Unlike the
    uniform sampler, every trained group carries a gradient signal."""

    min_group_size = 2  # a group of one never has differing rewards
    even_shares = False  # which groups are kept differs between ranks

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int = 0, max_gen_batches: int = 3, oversample: float = 1.0
    ):
        super().__init__(dataset, batch_size, seed)
        require(
            max_gen_batches >= 1 and oversample > 0, "sampler.max_gen_batches must be >= 1 and sampler.oversample > 0"
        )
        self.max_gen_batches, self.gen_size = max_gen_batches, max(1, math.ceil(batch_size * oversample))

    def sample(self, make_rollout: Callable[[list[dict]], Rollout]) -> tuple[Rollout, dict]:
        kept, n_kept, generated, batches = [], 0, 0, 0
        while n_kept < self.batch_size and batches < self.max_gen_batches:
            r = make_rollout(self.next_rows(self.gen_size))  # this rank's share of the groups
            batches, generated = batches + 1, generated + self.gen_size
            keep, n = first_informative(r, self.batch_size - n_kept)
            kept.append(r.select_groups(keep))
            n_kept += n
        stats = {
            "sampler/gen_batches": batches,
            "sampler/kept_groups": n_kept,
            "sampler/kept_frac": n_kept / max(generated, 1),
        }
        return Rollout.cat(kept), stats
