"""Advantage estimators: `estimator(rollout, values=None) -> [N, Tc]` per-token advantages.

Group estimators read the outcome rewards as a [P, G] matrix (rows of a group are contiguous)
and copy each completion's advantage to all its tokens.
"""
from __future__ import annotations

import torch

from rlkit.rollout import Rollout


def sequence_returns(r: Rollout) -> torch.Tensor:
    """Outcome reward of each completion, less any KL penalty placed in the reward.  -> [N]"""
    ret = r.rewards.float()  # [N]
    if r.kl_penalty is not None:
        ret = ret - (r.kl_penalty * r.completion_mask).sum(-1)  # [N]
    return ret


def grouped(r: Rollout) -> torch.Tensor:
    if r.group_size < 2:
        raise ValueError(f"group estimators need rollout.group_size >= 2, got {r.group_size}")
    return sequence_returns(r).view(-1, r.group_size)  # [P, G]


def centred(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r - mean_g(r), exactly 0 in groups whose rewards are all equal.  [P, G] -> [P, G], [P, 1]"""
    flat = (rewards == rewards[:, :1]).all(1, keepdim=True)  # [P, 1]
    diff = rewards - rewards.mean(1, keepdim=True)  # [P, G]
    return torch.where(flat, torch.zeros_like(diff), diff), flat


def per_token(adv: torch.Tensor, r: Rollout) -> torch.Tensor:
    return adv.reshape(-1, 1) * r.completion_mask  # [N, Tc]


class GRPO:
    """GRPO (Shao et al. 2024, arXiv 2402.03300): A_i = (r_i - mean_g r) / (std_g r + eps).
    `std`: 'sample' (N-1, as TRL and verl) or 'population' (N). Groups with equal rewards get 0."""

    min_group_size = 2
    needs_critic = False

    def __init__(self, std: str = "sample", eps: float = 1e-6):
        if std not in ("sample", "population"):
            raise ValueError(f"advantage.std must be 'sample' or 'population', got {std!r}")
        self.unbiased, self.eps = std == "sample", eps

    def __call__(self, r: Rollout, values: torch.Tensor | None = None) -> torch.Tensor:
        rewards = grouped(r)  # [P, G]
        diff, flat = centred(rewards)  # [P, G]
        std = rewards.std(1, unbiased=self.unbiased, keepdim=True)  # [P, 1]
        adv = torch.where(flat, diff, diff / (std + self.eps))  # [P, G]
        return per_token(adv, r)  # [N, Tc]
