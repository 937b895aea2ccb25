"""Reward terms and reward shaping: weighted reward functions (group `rewards`), how they combine,
and DAPO's overlong punishment, which any run can switch on."""

from __future__ import annotations

import math
import re
from contextlib import nullcontext
from functools import partial

import numpy as np
import torch

from rlkit.components import RewardFunction
from rlkit.refusals import require
from rlkit.tensors import centred


def overlong_penalty(lengths: torch.Tensor, budget: int, cache: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13): 0 up to
    budget - cache tokens, then falling linearly to -1 at the budget.  [N] -> [N]"""
    over = lengths.float() - (budget - cache)  # [N]
    return -(over / cache).clamp(0.0, 1.0)


class Accuracy(RewardFunction):
    """The task's own reward (for the testbed and the math task: 1 for a right final answer), times
    `by_difficulty[row's difficulty]` where that names the row's level (1 otherwise): under an
    estimator without the std division (Dr. GRPO) that level's groups weigh that much more in the
    update, a positive control for the difficulty-bias claim (GRPO's std division is scale-free, so
    there the weights change nothing)."""

    def __init__(self, weight: float = 1.0, by_difficulty: dict | None = None):
        try:
            levels = {int(k): float(v) for k, v in (by_difficulty or {}).items()}
        except (TypeError, ValueError):
            levels = None
        require(
            levels is not None and all(0 < v < math.inf for v in levels.values()),
            f"by_difficulty's weights must be > 0, got {by_difficulty} (difficulty level: finite weight)",
        )
        self.weight, self.by_difficulty = weight, levels

    def __call__(self, row: dict, completion: str, task) -> float:
        return task.reward(row, completion) * self.by_difficulty.get(row.get("difficulty"), 1.0)


class Format(RewardFunction):
    """1 when the completion matches `pattern` (a regular expression, searched), else 0; as
    DeepSeek-R1-Zero's format reward (arXiv 2501.12948)."""

    def __init__(self, pattern: str, weight: float = 1.0):
        self.pattern, self.weight = re.compile(pattern, re.DOTALL), weight

    def __call__(self, row: dict, completion: str, task) -> float:
        return float(bool(self.pattern.search(completion)))


class Feature(RewardFunction):
    """The task's own per-completion feature `name` (`task.features(completion)[name]`) as the
    reward: e.g. the graded testbed's `formatted`, a format-only control that pays for the answer
    sentence whether or not its number is right."""

    def __init__(self, name: str, weight: float = 1.0):
        self.name, self.weight = name, weight

    def __call__(self, row: dict, completion: str, task) -> float:
        values = task.features(completion) if task.features is not None else {}  # once per completion
        require(self.name in values, f"the task has no feature {self.name!r}")
        return float(values[self.name])


class LengthPenalty(RewardFunction):
    """0 up to `max_chars` characters, then falling linearly to -1 at twice that."""

    def __init__(self, max_chars: int, weight: float = 1.0):
        require(max_chars >= 1, f"max_chars must be >= 1, got {max_chars}")
        self.max_chars, self.weight = max_chars, weight

    def __call__(self, row: dict, completion: str, task) -> float:
        return -min(1.0, max(0, len(completion) - self.max_chars) / self.max_chars)


def group_zscore(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group's z-score (sample std), exactly 0 in groups whose values are all equal.  [N] -> [N]"""
    g = x.view(-1, group_size)  # [P, G]
    diff, flat = centred(g)  # [P, G], [P, 1]
    return torch.where(flat, diff, diff / g.std(1, keepdim=True).clamp(min=1e-12)).reshape(-1)  # [N]


def combine(parts: torch.Tensor, weights: list[float], group_size: int, mode: str) -> torch.Tensor:
    """One reward per completion from K reward terms [N, K]: `sum` adds the weighted terms (the
    estimator then normalises the sum); `normalise` z-scores each term within its group first, then
    adds them (GDPO, arXiv 2601.05242), so a term with a small spread is not drowned out.  -> [N]"""
    w = torch.tensor(weights, dtype=parts.dtype)  # [K]
    if mode == "normalise":  # else "sum" (`reward.combine`, checked with the config)
        return torch.stack([group_zscore(parts[:, k], group_size) for k in range(parts.shape[1])], 1) @ w
    return parts @ w


def score(
    task, functions: dict, mode: str, rows: list[dict], texts: list[str], group_size: int, timeout_s=0, timer=None
):
    """Rewards of N completions: the task's own, or the reward functions' terms combined as `mode`
    says (`term`).  -> rewards [N], terms [N, K] (None without functions)"""
    if not functions:
        return task.score(rows, texts, timeout_s=timeout_s), None
    parts = torch.stack([term(task, fn, name, rows, texts, timeout_s, timer) for name, fn in functions.items()], 1)
    return combine(parts, [fn.weight for fn in functions.values()], group_size, mode), parts  # [N], [N, K]


def term(task, fn, name: str, rows: list[dict], texts: list[str], timeout_s: float, timer=None) -> torch.Tensor:
    """One reward function's values for N completions: a batched one (a model, `fn.batch`) in one
    call, timed as `reward_<name>` by `timer`; any other per completion, each call limited to
    `timeout_s` seconds.  -> [N]"""
    if not hasattr(fn, "batch"):
        return task.score(rows, texts, partial(fn, task=task), name, timeout_s)
    with timer(f"reward_{name}") if timer is not None else nullcontext():
        values = torch.tensor(fn.batch(rows, texts), dtype=torch.float)  # [N]
    require(
        values.shape == (len(texts),) and bool(torch.isfinite(values).all()),
        f"reward.functions.{name}: its batch gave {values.tolist()} for {len(texts)} completions, not finite numbers",
    )
    return values


def correct(functions: dict, rewards: torch.Tensor, parts: torch.Tensor | None, verdicts=None) -> torch.Tensor:
    """Which answers are right, whatever else the reward pays for: the episodes' own `verdicts` [N]
    where they give them (`rlkit.environments.verdicts`), else the first `Accuracy` term > 0 when the
    reward functions have one, else the reward > 0 (the task's own, or the combined terms where none
    is the task's).  [N], [N, K] -> [N] bool"""
    if verdicts is not None:
        return verdicts
    terms = [k for k, fn in enumerate(functions.values()) if isinstance(fn, Accuracy)]
    return parts[:, terms[0]] > 0 if terms and parts is not None else rewards > 0


def shuffled(rewards: torch.Tensor, group_size: int, mode: str) -> torch.Tensor:
    """The shuffled-reward control (`reward.shuffle`): `step` permutes the step's rewards across all
    its completions; `group` permutes each group's rewards among its own completions, so every
    group keeps its mean and spread and only the link to the completions is lost.  [N] -> [N]"""
    if mode == "step":
        return rewards[torch.randperm(len(rewards))]
    if mode == "group":
        groups = len(rewards) // group_size
        order = torch.rand(groups, group_size).argsort(-1) + torch.arange(groups)[:, None] * group_size  # [P, G]
        return rewards[order.flatten().to(rewards.device)]
    return rewards


def step_reward_matrix(
    step_rewards: list[list[tuple[int, float]]], completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place each step's reward on the token where the step's text ends.
    Returns rewards [N, Tc] and a step mask [N, Tc]."""
    N, T = completion_ids.shape
    rewards, mask = torch.zeros(N, T), torch.zeros(N, T, dtype=torch.bool)
    lengths = completion_mask.sum(-1).tolist()
    for i, (steps, ids) in enumerate(zip(step_rewards, completion_ids.tolist())):
        pieces = tokenizer.batch_decode([[t] for t in ids[: lengths[i]]], skip_special_tokens=True)
        ends = np.cumsum([len(p) for p in pieces])  # characters decoded up to each token
        for end, reward in steps:
            t = min(int(np.searchsorted(ends, end)), lengths[i] - 1)  # token holding the step's last character
            rewards[i, t] += reward
            mask[i, t] = True
    return rewards.to(completion_ids.device), mask.to(completion_ids.device)
