"""Policy losses (config group `loss`): per-token loss matrices [n, Tc] and their statistics.

Every loss shares the KL to a frozen reference (k1, k2, k3; in the loss or in the reward), an
entropy bonus and DAPO's overlong filtering through `Regularised`; each subclass writes only its
surrogate. PPO's clipped surrogate is GRPO's; GSPO, CISPO and SAPO change how the importance
ratio enters.
"""
from __future__ import annotations

import torch

from rlkit.components import PolicyLoss
from rlkit.types import Rollout


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token (Schulman 2020):
    k1 = log(pi/ref), k2 = 0.5*log(pi/ref)^2, k3 = ref/pi - log(ref/pi) - 1 (>= 0)."""
    log_ratio = logp - ref_logp  # [N, Tc]
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"loss.kl_estimator must be one of k1, k2, k3, got {kind!r}")


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float,
                      eps_high: float, dual_clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """-min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A); with `dual_clip` c > 1, a negative-
    advantage token's loss is also capped at -c*A (Ye et al. 2020, arXiv 1912.09729)."""
    ratio = torch.exp(logp - old_logp)  # [N, Tc]
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)  # [N, Tc]
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)  # [N, Tc]
    with torch.no_grad():
        stats = {"clip_frac_low": (ratio < 1 - eps_low) & (adv < 0), "clip_frac_high": (ratio > 1 + eps_high) & (adv > 0),
                 "ratio_dev": (ratio - 1).abs()}
    return loss, stats


def _check_eps(eps_low: float, eps_high: float, low_max: float = 1.0) -> None:
    if not 0 <= eps_low < low_max:
        raise ValueError(f"loss.eps_low must be in [0, {low_max:g}), got {eps_low}")
    if eps_high < 0:
        raise ValueError(f"loss.eps_high must be >= 0, got {eps_high}")


class Regularised(PolicyLoss):
    """What every loss can add to its surrogate: `beta` times a KL estimate to the reference, in
    the loss (GRPO) or subtracted from the per-token reward (PPO, RLOO); an entropy bonus; and
    `drop_truncated` (DAPO's overlong filtering: completions that hit the budget get no loss)."""

    def __init__(self, beta: float = 0.0, kl_estimator: str = "k3", kl_placement: str = "loss",
                 entropy_coef: float = 0.0, drop_truncated: bool = False):
        if beta < 0:
            raise ValueError(f"loss.beta must be >= 0, got {beta}")
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"loss.kl_estimator must be one of k1, k2, k3, got {kl_estimator!r}")
        if kl_placement not in ("loss", "reward"):
            raise ValueError(f"loss.kl_placement must be 'loss' or 'reward', got {kl_placement!r}")
        self.beta, self.kl_estimator, self.entropy_coef = beta, kl_estimator, entropy_coef
        self.kl_in_reward, self.entropy_grad = beta > 0 and kl_placement == "reward", entropy_coef != 0
        self.drop_truncated = drop_truncated

    def surrogate(self, logp, old_logp, adv, mask) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def __call__(self, logp, old_logp, adv, mask, ref_logp=None, entropy=None) -> tuple[torch.Tensor, dict]:
        loss, stats = self.surrogate(logp, old_logp, adv, mask)  # [n, Tc]
        if ref_logp is not None:
            kl = kl_estimate(logp, ref_logp, self.kl_estimator)  # [n, Tc]
            stats["kl"] = kl.detach()
            if not self.kl_in_reward:
                loss = loss + self.beta * kl
        if entropy is not None and self.entropy_coef:
            loss = loss - self.entropy_coef * entropy
        return loss, stats  # [n, Tc]

    def kl_penalty(self, old_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        return self.beta * kl_estimate(old_logp, ref_logp, self.kl_estimator)  # [N, Tc]

    def train_mask(self, rollout: Rollout) -> torch.Tensor:
        mask = rollout.completion_mask.float()  # [N, Tc]
        return mask * (~rollout.truncated)[:, None] if self.drop_truncated else mask


class PPOClip(Regularised):
    """PPO's clipped surrogate as GRPO uses it (arXiv 1707.06347, 2402.03300), per token:
    -min(r A, clip(r, 1-eps_low, 1+eps_high) A), with DAPO's clip-higher (eps_high 0.28, arXiv
    2503.14476) and an optional dual clip."""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None, **regularise):
        super().__init__(**regularise)
        _check_eps(eps_low, eps_high)
        if dual_clip is not None and dual_clip <= 1:
            raise ValueError(f"loss.dual_clip must be > 1 or null, got {dual_clip}")
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip

    def surrogate(self, logp, old_logp, adv, mask):
        return clipped_surrogate(logp, old_logp, adv, self.eps_low, self.eps_high, self.dual_clip)


class GSPO(Regularised):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, the geometric
    mean of its token ratios s_i = exp(mean_t(logp - old_logp)), clipped per sequence:
    -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), A_i the sequence's mean token advantage.
    Unlike GRPO a sequence is kept or clipped whole. The per-sequence loss is placed on each of its
    tokens, so `aggregator=seq_mean_token_mean` gives the paper's mean over sequences."""

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, **regularise):
        super().__init__(**regularise)
        _check_eps(eps_low, eps_high)
        self.eps_low, self.eps_high = eps_low, eps_high

    def surrogate(self, logp, old_logp, adv, mask):
        lengths = mask.sum(-1).clamp(min=1)  # [n]
        log_s = ((logp - old_logp) * mask).sum(-1) / lengths  # [n]
        seq_adv = (adv * mask).sum(-1) / lengths  # [n]
        loss, stats = clipped_surrogate(log_s, torch.zeros_like(log_s), seq_adv, self.eps_low, self.eps_high)  # [n]
        return loss[:, None] * mask, {k: v[:, None].float() * mask for k, v in stats.items()}  # [n, Tc]


class CISPO(Regularised):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1-eps_low, 1+eps_high)) A logp. The
    importance weight is clipped and its gradient stopped, so unlike PPO no token loses its
    gradient; eps_low 1.0 puts no effective lower bound (the paper's choice), eps_high 0.28 is ours."""

    def __init__(self, eps_low: float = 1.0, eps_high: float = 0.28, **regularise):
        super().__init__(**regularise)
        _check_eps(eps_low, eps_high, low_max=float("inf"))
        self.eps_low, self.eps_high = eps_low, eps_high

    def surrogate(self, logp, old_logp, adv, mask):
        ratio = torch.exp(logp - old_logp).detach()  # [n, Tc]
        weight = ratio.clamp(max(1 - self.eps_low, 0.0), 1 + self.eps_high)  # [n, Tc]
        stats = {"clip_frac_low": ratio < 1 - self.eps_low, "clip_frac_high": ratio > 1 + self.eps_high,
                 "ratio_dev": (ratio - 1).abs()}
        return -weight * adv * logp, stats  # [n, Tc]


class SAPO(Regularised):
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate instead of the
    hard clip, -(4/tau) sigmoid(tau (r - 1)) A, with tau_pos for A > 0 and tau_neg otherwise.
    Its gradient at r = 1 equals PPO's; away from 1 it fades smoothly instead of dropping to 0.
    `gate` logs the gradient's weight relative to PPO's, 4 s (1 - s) with s the sigmoid."""

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05, **regularise):
        super().__init__(**regularise)
        if tau_pos <= 0 or tau_neg <= 0:
            raise ValueError(f"loss.tau_pos and loss.tau_neg must be > 0, got {tau_pos} and {tau_neg}")
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def surrogate(self, logp, old_logp, adv, mask):
        ratio = torch.exp(logp - old_logp)  # [n, Tc]
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg)  # [n, Tc]
        gate = torch.sigmoid(tau * (ratio - 1))  # [n, Tc]
        stats = {"ratio_dev": (ratio - 1).abs().detach(), "gate": (4 * gate * (1 - gate)).detach()}
        return -(4 / tau) * gate * adv, stats  # [n, Tc]
