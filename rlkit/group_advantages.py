"""More outcome-reward advantage estimators (config group `advantage`), each a different baseline
or scale for the group-relative advantage: REINFORCE++ and its group baseline (batch whitening),
MaxRL (normalised by the group mean), GPG (rescaled by the share of non-zero rewards), OPO (a
length-weighted group baseline), the pass@k advantage (only a group's best completion), KRPO
(a Kalman-filtered running baseline) and the optimal token baseline (a baseline per position,
weighted by the old policy's realized energy)."""

from __future__ import annotations

import torch

from rlkit import parallel
from rlkit.advantages import grouped, masked_whiten, per_token, sequence_returns
from rlkit.components import AdvantageEstimator
from rlkit.tensors import centred


def token_returns(r) -> torch.Tensor:
    """Undiscounted return at each of the model's tokens: the outcome reward (and shaping) on its
    last token, less the KL penalty of this token and every later one.  -> [N, Tc]"""
    mask = r.action_mask.float()  # [N, Tc]
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1)  # [N] the model's last token
    rewards = torch.zeros_like(mask)  # [N, Tc]
    rewards[torch.arange(len(last), device=mask.device), last] = r.rewards.float() + r.shaping.float()
    if r.kl_penalty is not None:
        rewards = rewards - r.kl_penalty * mask
    return rewards.flip(-1).cumsum(-1).flip(-1) * mask  # [N, Tc]


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): no group (G = 1 works); each model token's
    return (the outcome reward less the KL penalty from this token on: put the KL in the reward,
    `loss.kl_placement=reward`, as the paper does) whitened over every token of the batch (mean
    and sample std of the model's tokens, all processes)."""

    min_group_size = 1

    def __call__(self, r, values=None) -> torch.Tensor:
        return masked_whiten(token_returns(r), r.action_mask)  # [N, Tc]


class ReinforcePPBaseline(AdvantageEstimator):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): A_i = r_i - mean_g r, then
    whitened over every token of the batch like REINFORCE++ (a long completion's tokens weigh
    more in the batch statistics)."""

    def __call__(self, r, values=None) -> torch.Tensor:
        return masked_whiten(per_token(centred(grouped(r))[0], r), r.action_mask)  # [N, Tc]


class MaxRL(AdvantageEstimator):
    """MaxRL (arXiv 2602.02710): A_i = (r_i - mean_g r) / (mean_g r + eps), the group-relative
    advantage normalised by the group's mean reward (its success rate for 0/1 rewards), so a
    rarely solved question's correct answers weigh more, by 1/p rather than GRPO's 1/sqrt(p(1-p))."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, r, values=None) -> torch.Tensor:
        rewards = grouped(r)  # [P, G]
        mean = rewards.mean(1, keepdim=True)  # [P, 1]
        return per_token((rewards - mean) / (mean + self.eps), r)  # [N, Tc]


class GPG(AdvantageEstimator):
    """GPG (Chu et al. 2025, arXiv 2504.02546): A_i = alpha (r_i - mean_g r) / f_norm with
    alpha = B / M, B the batch's completions and M those with a non-zero reward (every process),
    so the gradient is not shrunk by groups without signal. Pair it with `loss=pg`, GPG's plain
    policy gradient."""

    def __init__(self, f_norm: float = 1.0):
        self.f_norm = f_norm

    def __call__(self, r, values=None) -> torch.Tensor:
        returns = sequence_returns(r)  # [N]
        counts = parallel.total(returns.new_tensor([float(len(returns)), float((returns != 0).sum())]))  # [2] B, M
        alpha = counts[0] / counts[1].clamp(min=1)
        return per_token(alpha * centred(grouped(r))[0] / self.f_norm, r)  # [N, Tc]


class OPO(AdvantageEstimator):
    """OPO (Hao et al. 2025, arXiv 2505.23585): the optimal baseline for sequence rewards under
    length-proportional gradient variance, b = sum_g l_j r_j / sum_g l_j (l the completion's
    model tokens); A_i = r_i - b."""

    def __call__(self, r, values=None) -> torch.Tensor:
        rewards = grouped(r)  # [P, G]
        lengths = r.action_mask.float().sum(-1).view_as(rewards)  # [P, G]
        baseline = (lengths * rewards).sum(1, keepdim=True) / lengths.sum(1, keepdim=True).clamp(min=1)  # [P, 1]
        return per_token(rewards - baseline, r)  # [N, Tc]


class PassK(AdvantageEstimator):
    """The pass@k advantage (arXiv 2503.19595; verl `grpo_passk`): only each group's best
    completion gets an advantage, r_max - r_second_max (divided by the group's sample std + eps
    with `std: true`); every other completion, and every completion of a group whose two best are
    equal, gets 0. Of tied best completions the first gets it (their advantage is 0 anyway)."""

    def __init__(self, std: bool = True, eps: float = 1e-6):
        self.std, self.eps = std, eps

    def __call__(self, r, values=None) -> torch.Tensor:
        rewards = grouped(r)  # [P, G]
        top, index = rewards.topk(2, dim=1)  # [P, 2] each
        gap = top[:, 0] - top[:, 1]  # [P]
        if self.std:
            gap = gap / (rewards.std(1) + self.eps)
        adv = torch.zeros_like(rewards).scatter(1, index[:, :1], gap[:, None])  # [P, G]
        return per_token(adv, r)  # [N, Tc]


class KRPO(AdvantageEstimator):
    """KRPO (Wang et al. 2025, arXiv 2505.07527, as the authors' code has it): a one-dimensional
    Kalman filter runs over each group's rewards in completion order (state mean 0, variance 1 at
    the start; process noise Q, measurement noise R); completion i's advantage is
    (r_i - x_i) / (sqrt(P_i) + eps), x_i and P_i the filter's mean and variance after it has seen
    r_i. Unlike GRPO's group mean, the baseline is a running estimate, so the advantages depend on
    the completions' order."""

    def __init__(self, process_var: float = 1e-5, meas_var: float = 1e-2, eps: float = 1e-8):
        self.q, self.r, self.eps = process_var, meas_var, eps

    def __call__(self, r, values=None) -> torch.Tensor:
        rewards = grouped(r)  # [P, G]
        x, p = rewards.new_zeros(len(rewards)), rewards.new_ones(len(rewards))  # [P] each, one filter per group
        adv = torch.empty_like(rewards)  # [P, G]
        for i in range(rewards.shape[1]):
            gain = (p + self.q) / (p + self.q + self.r)  # [P]
            x, p = x + gain * (rewards[:, i] - x), (1 - gain) * (p + self.q)
            adv[:, i] = (rewards[:, i] - x) / (p.sqrt() + self.eps)
        return per_token(adv, r)  # [N, Tc]


class OTB(AdvantageEstimator):
    """The optimal token baseline (arXiv 2602.07078; verl `optimal_token_baseline`): each model
    token's return G_t (`token_returns`) less a baseline per group and position t,
    B_t = sum_i G_t W_t / (sum_i W_t + eps) over the group's completions, with the realized energy
    W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_v^2) of the old policy at the sampling temperature (the
    logit-gradient proxy of |grad log pi|^2; `Rollout.policy_stats`, which the core computes for an
    estimator that `needs_policy_stats`). `zero_tail`: a completion longer than every other of its
    group gets baseline 0 past the second-longest (verl's `handle_zero_tail`; off by default, as
    there), where it would otherwise be its own return and its advantage 0."""

    needs_policy_stats = True

    def __init__(self, eps: float = 1e-8, zero_tail: bool = False):
        self.eps, self.zero_tail = eps, zero_tail

    def __call__(self, r, values=None) -> torch.Tensor:
        old_logp, sum_pi_sq = r.policy_stats.unbind(-1)  # [N, Tc] each
        mask = r.action_mask.float()  # [N, Tc]
        returns = token_returns(r)  # [N, Tc]
        energy = ((1 - 2 * old_logp.exp() + sum_pi_sq) * mask).cumsum(-1)  # [N, Tc] W_t
        P, G, T = r.num_groups, r.group_size, mask.shape[1]
        w, m = (energy * mask).view(P, G, T), mask.view(P, G, T)  # [P, G, T] each
        baseline = (returns.view(P, G, T) * w).sum(1, keepdim=True) / (w.sum(1, keepdim=True) + self.eps)  # [P, 1, T]
        baseline = baseline.expand(P, G, T).clone()  # [P, G, T]
        if self.zero_tail:
            top = m.sum(-1).topk(2, dim=1)  # values, indices [P, 2]: the two longest of each group
            alone = top.values[:, 0] > top.values[:, 1]  # [P] one completion longer than every other
            past = torch.arange(T, device=mask.device)[None] >= top.values[:, 1:]  # [P, T] past the second-longest
            baseline[torch.arange(P, device=mask.device), top.indices[:, 0]] *= ~(alone[:, None] & past)
        return (returns - baseline.view(-1, T)) * mask  # [N, Tc]
