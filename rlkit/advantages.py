"""Advantage estimators (config group `advantage`): `estimator(rollout, values=None)` returns
per-token advantages [N, Tc], or (advantages, returns) when it trains a critic (protocol:
`rlkit.components.AdvantageEstimator`).

Group estimators read the outcome rewards as a [P, G] matrix (rows of a group are contiguous)
and copy each completion's advantage to all its tokens.
"""

from __future__ import annotations

import torch

from rlkit import parallel
from rlkit.components import AdvantageEstimator
from rlkit.refusals import require
from rlkit.tensors import centred
from rlkit.types import Rollout


def sequence_returns(r: Rollout) -> torch.Tensor:
    """Outcome reward of each completion plus reward shaping, less any KL penalty placed in the
    reward.  -> [N]"""
    ret = r.rewards.float() + r.shaping.float()  # [N]
    if r.kl_penalty is not None:
        ret = ret - (r.kl_penalty * r.action_mask).sum(-1)  # [N] over the model's own tokens
    return ret


def grouped(r: Rollout) -> torch.Tensor:
    require(r.group_size >= 2, f"group estimators need rollout.group_size >= 2, got {r.group_size}")
    return sequence_returns(r).view(-1, r.group_size)  # [P, G]


def per_token(adv: torch.Tensor, r: Rollout) -> torch.Tensor:
    return adv.reshape(-1, 1) * r.action_mask  # [N, Tc] 0 on an environment's tokens


class GRPO(AdvantageEstimator):
    """GRPO (Shao et al. 2024, arXiv 2402.03300): A_i = (r_i - mean_g r) / (std_g r + eps).
    `std`: 'sample' (N-1, as TRL and verl) or 'population' (N). Groups with equal rewards get 0.
    `std_scope`: 'group' (the paper) or 'batch': divide by the std of all rewards in the batch
    instead, keeping the group mean (arXiv 2508.08221), so easy and hard groups are not
    up-weighted by their own small std."""

    def __init__(self, std: str = "sample", eps: float = 1e-6, std_scope: str = "group"):
        require(std in ("sample", "population"), f"advantage.std must be 'sample' or 'population', got {std!r}")
        require(std_scope in ("group", "batch"), f"advantage.std_scope must be 'group' or 'batch', got {std_scope!r}")
        self.unbiased, self.eps, self.batch_std = std == "sample", eps, std_scope == "batch"

    def __call__(self, r: Rollout, values: torch.Tensor | None = None) -> torch.Tensor:
        rewards = grouped(r)  # [P, G]
        diff, flat = centred(rewards)  # [P, G]
        if self.batch_std:
            std = parallel.mean_std(rewards.reshape(-1), self.unbiased)[1]  # [] over every rank's rewards
        else:
            std = rewards.std(1, unbiased=self.unbiased, keepdim=True)  # [P, 1]
        adv = torch.where(flat, diff, diff / (std + self.eps))  # [P, G]
        return per_token(adv, r)  # [N, Tc]


class DrGRPO(AdvantageEstimator):
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): A_i = r_i - mean_g r. Unlike GRPO there is
    no std division, so low-variance (very easy or very hard) groups are not up-weighted; pair it
    with `seq_mean_token_sum_norm` to also remove the length bias."""

    def __call__(self, r: Rollout, values: torch.Tensor | None = None) -> torch.Tensor:
        return per_token(centred(grouped(r))[0], r)  # [N, Tc]


class RLOO(AdvantageEstimator):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740): the baseline is the mean
    of the other G-1 rewards, A_i = r_i - (sum_g r - r_i)/(G-1) = G/(G-1) (r_i - mean_g r).
    Unlike GRPO, no std division; the baseline is unbiased because it excludes r_i."""

    def __call__(self, r: Rollout, values: torch.Tensor | None = None) -> torch.Tensor:
        G = r.group_size
        return per_token(centred(grouped(r))[0] * (G / (G - 1)), r)  # [N, Tc]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of every rank; std 1 with fewer than two entries."""
    m = mask.bool()
    mean, std, n = parallel.mean_std(x[m])
    return torch.where(m, (x - mean) / ((std if n > 1 else 1.0) + eps), torch.zeros_like(x))  # [N, Tc]


class GAE(AdvantageEstimator):
    """PPO with a learned critic and GAE (Schulman et al. 2016, arXiv 1506.02438; PPO arXiv
    1707.06347). Unlike GRPO the baseline is a per-token value V_t, not a group statistic:
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_{s>=t} (gamma lam)^{s-t} delta_s; the outcome
    reward sits on the last completion token; advantages are whitened over the batch; returns
    A + V (before whitening) train the critic. Needs no groups (G = 1 works)."""

    min_group_size = 1
    needs_critic = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True):
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __call__(self, r: Rollout, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """In a multi-turn episode the steps are the model's own tokens: an environment's tokens are
        skipped (V_{t+1} is the value at the model's next token), so the advantages are those of the
        model's tokens laid side by side."""
        require(values is not None, "advantage=gae needs critic values")
        mask = r.action_mask.float()  # [N, Tc]
        order = torch.sort((mask == 0).to(torch.int8), dim=1, stable=True).indices  # [N, Tc] model tokens first
        kl = None if r.kl_penalty is None else r.kl_penalty.gather(1, order)  # [N, Tc]
        reward = r.rewards.float() + r.shaping.float()  # [N] on the model's last token
        adv, returns = self.packed(values.gather(1, order), mask.gather(1, order), reward, kl)  # [N, Tc] each
        adv, returns = (torch.zeros_like(x).scatter(1, order, x) for x in (adv, returns))  # back in place
        return (masked_whiten(adv, mask) if self.whiten else adv * mask), returns

    def packed(self, values, mask, reward, kl) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE of rows whose steps are left-aligned (`mask` [N, Tc] ones then zeros).  -> A, A + V [N, Tc]"""
        T = mask.shape[1]
        values = values * mask  # [N, Tc] V beyond the end is 0
        rewards = torch.zeros_like(mask)  # [N, Tc]
        last = (mask.sum(-1).long() - 1).clamp(min=0)  # [N]
        rewards[torch.arange(len(last)), last] = reward
        if kl is not None:
            rewards = rewards - kl * mask
        next_v = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)  # [N, Tc]
        delta = (rewards + self.gamma * next_v - values) * mask  # [N, Tc]
        t = torch.arange(T, dtype=mask.dtype, device=mask.device)
        gap = t[None, :] - t[:, None]  # [Tc, Tc] s - t
        discount = torch.where(gap >= 0, (self.gamma * self.lam) ** gap.clamp(min=0), torch.zeros_like(gap))
        adv = delta @ discount.T  # [N, Tc] A_t = sum_s (gamma lam)^(s-t) delta_s
        return adv, (adv + values) * mask


class ProcessSupervision(AdvantageEstimator):
    """Process supervision (Shao et al. 2024, arXiv 2402.03300, section 4.1.3): each reasoning
    step has a reward; all step rewards of a group are normalised by the group's mean and std,
    and a token's advantage is the sum of the normalised rewards of the steps ending at or after
    it. Unlike GRPO, tokens of one completion get different advantages."""

    needs_step_rewards = True

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, r: Rollout, values: torch.Tensor | None = None) -> torch.Tensor:
        require(r.step_rewards is not None, "advantage=process needs step rewards from the task")
        G, (N, T) = r.group_size, r.step_rewards.shape
        steps = r.step_mask.view(-1, G * T).float()  # [P, G*Tc] 1 where a step ends
        raw = r.step_rewards.view(-1, G * T)  # [P, G*Tc]
        count = steps.sum(1, keepdim=True).clamp(min=1)  # [P, 1]
        mean = (raw * steps).sum(1, keepdim=True) / count  # [P, 1]
        var = (((raw - mean) * steps) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)  # [P, 1] sample var
        norm = torch.where(var > 0, (raw - mean) / (var.sqrt() + self.eps), torch.zeros_like(raw)) * steps
        norm = norm.view(N, T)  # [N, Tc]
        return norm.flip(-1).cumsum(-1).flip(-1) * r.action_mask  # [N, Tc] sum over steps ending at or after t
