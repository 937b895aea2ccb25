"""Policy losses beyond PPO's clipped surrogate (config group `loss`): GPG's plain policy gradient,
DPPO's divergence mask, TOPR's tapered importance weights, Kimi k1.5's squared log-ratio,
CE-GPPO's gradient-preserving clip, ASPO's flipped weight for positive tokens and BAPO's clip bounds
searched per micro-batch."""

from __future__ import annotations

import math

import torch

from rlkit.losses import Regularised, clipped_surrogate
from rlkit.refusals import require


class PolicyGradient(Regularised):
    """The plain policy gradient, -A * log pi_theta per token (GPG, Chu et al. 2025, arXiv
    2504.02546; verl `gpg`): no ratio and no clip, so only one update per rollout is on-policy."""

    def surrogate(self, logp, old_logp, adv, mask):
        return -adv * logp, {}  # [n, Tc]


class DPPO(Regularised):
    """DPPO (arXiv 2602.04879): the ratio r = pi_theta / pi_old unclipped, -r A per token, with a
    token masked out (no gradient) when the policy has moved too far from pi_old in the direction
    its advantage pushes: `binary_tv` masks A > 0 with pi_theta - pi_old > delta_high and A < 0 with
    pi_old - pi_theta > delta_low (probabilities of the sampled token); `binary_kl` the same with
    the two-point KL between Bernoulli(pi_old) and Bernoulli(pi_theta) past delta. pi_old is the
    trainer's policy when the rollout was made (the engine's when they agree); SkyRL's `dppo`."""

    def __init__(self, kind: str = "binary_tv", delta_low: float = 0.1, delta_high: float = 0.1, **regularise):
        super().__init__(**regularise)
        require(kind in ("binary_tv", "binary_kl"), f"loss.kind must be binary_tv or binary_kl, got {kind!r}")
        require(min(delta_low, delta_high) > 0, f"loss.delta_low and delta_high must be > 0: {delta_low}, {delta_high}")
        self.kind, self.delta_low, self.delta_high = kind, delta_low, delta_high

    def surrogate(self, logp, old_logp, adv, mask):
        ratio = torch.exp(logp - old_logp)  # [n, Tc]
        with torch.no_grad():
            p, mu = logp.exp(), old_logp.exp()  # [n, Tc] each
            if self.kind == "binary_tv":
                up, down = p - mu > self.delta_high, mu - p > self.delta_low  # [n, Tc] each
            else:
                eps = 1e-8
                kl = mu * (old_logp - logp) + (1 - mu) * torch.log((1 - mu + eps) / (1 - p + eps))  # [n, Tc]
                up, down = (p > mu) & (kl > self.delta_high), (p < mu) & (kl > self.delta_low)
            dropped = ((adv > 0) & up) | ((adv < 0) & down)  # [n, Tc]
        return -ratio * adv * (~dropped), {"masked_frac": dropped.float(), "ratio_dev": (ratio - 1).abs().detach()}


class TOPR(Regularised):
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025, arXiv 2503.14286; ROLL `topr`): a
    row with a positive reward is trained like supervised learning, -A log pi (no importance
    weight); any other row with its importance weight truncated to [0, 1] and its gradient stopped,
    -sg(clip(r, 0, 1)) A log pi, so negative examples cannot push pi_theta far below pi_old.
    `positive_weight` and `negative_weight` scale the two parts (1 and 1, as the paper)."""

    def __init__(self, positive_weight: float = 1.0, negative_weight: float = 1.0, **regularise):
        super().__init__(**regularise)
        self.weights = positive_weight, negative_weight

    def weighted_surrogate(self, x):
        require(x.reward is not None, "loss=topr splits rows by their reward; this loss input has none")
        positive = (x.reward > 0)[:, None].float()  # [n, 1]
        ratio = torch.exp(x.logp - x.old_logp).detach()  # [n, Tc]
        weight = self.weights[0] * positive + self.weights[1] * (1 - positive) * ratio.clamp(0, 1)  # [n, Tc]
        loss = -weight * x.adv * x.logp  # [n, Tc]
        stats = {"truncated_frac": ((1 - positive) * (ratio > 1)).expand_as(loss), "ratio_dev": (ratio - 1).abs()}
        return (loss if x.is_weight is None else loss * x.is_weight), stats


class Kimi(Regularised):
    """The Kimi k1.5 policy loss (Kimi Team 2025, arXiv 2501.12599, eq. 3; ROLL `kimi15`):
    -A log pi_theta + tau/2 (log pi_theta - log pi_old)^2 per token, a plain policy gradient with a
    squared log-ratio penalty in place of ratio clipping; `tau` 0.1 (ROLL's default)."""

    def __init__(self, tau: float = 0.1, **regularise):
        super().__init__(**regularise)
        require(tau >= 0, f"loss.tau must be >= 0, got {tau}")
        self.tau = tau

    def surrogate(self, logp, old_logp, adv, mask):
        log_ratio = logp - old_logp  # [n, Tc]
        return -adv * logp + 0.5 * self.tau * log_ratio**2, {"ratio_dev": (log_ratio.exp() - 1).abs().detach()}


class CEGPPO(Regularised):
    """CE-GPPO (Su et al. 2025, arXiv 2509.20712, as the authors' code has it): PPO's clip range,
    but a token outside it keeps a bounded gradient instead of none. A < 0 below 1 - eps_low:
    -beta_low (1 - eps_low) r / sg(r) A; A > 0 above 1 + eps_high: -beta_high (1 + eps_high) r / sg(r) A
    (the clipped value, with the gradient of log pi scaled by beta (1 +- eps)); elsewhere -r A; and a
    negative-advantage token's loss capped at -dual_clip A. beta_low < 1 keeps entropy from
    collapsing, beta_high the reverse; 0.75 and 1.0 as the authors' 7B run, dual clip 3."""

    def __init__(self, eps_low=0.2, eps_high=0.2, beta_low=0.75, beta_high=1.0, dual_clip=3.0, **regularise):
        super().__init__(**regularise)
        require(0 <= eps_low < 1 and eps_high >= 0, f"loss.eps_low in [0, 1), eps_high >= 0: {eps_low}, {eps_high}")
        require(beta_low >= 0 and beta_high >= 0 and dual_clip > 1, "loss.beta_low, beta_high >= 0, dual_clip > 1")
        self.eps, self.betas, self.dual_clip = (eps_low, eps_high), (beta_low, beta_high), dual_clip

    def surrogate(self, logp, old_logp, adv, mask):
        ratio = torch.exp(logp - old_logp)  # [n, Tc]
        kept = ratio / ratio.detach()  # [n, Tc] 1, with the gradient of log pi
        low = (ratio < 1 - self.eps[0]) & (adv < 0)
        high = (ratio > 1 + self.eps[1]) & (adv > 0)
        loss = torch.where(low, -self.betas[0] * (1 - self.eps[0]) * kept * adv, -ratio * adv)  # [n, Tc]
        loss = torch.where(high, -self.betas[1] * (1 + self.eps[1]) * kept * adv, loss)
        loss = torch.where(adv < 0, torch.minimum(loss, -self.dual_clip * adv), loss)  # [n, Tc]
        return loss, {
            "clip_frac_low": low.float(),
            "clip_frac_high": high.float(),
            "ratio_dev": (ratio - 1).abs().detach(),
        }


class ASPO(Regularised):
    """ASPO (Wang et al. 2025, arXiv 2510.06062, as the authors' Archer2.0 code has it): a positive-
    advantage token's importance weight is flipped, its loss -A c / sg(c)^2 with c = min(r, 1 + eps)
    (value -A / c, gradient in log pi -A / c: low-probability tokens the policy moved away from are
    pushed up harder, tokens it already raised less); a negative one keeps PPO's -A max(r, 1 - eps).
    A soft dual clip replaces a weight past `dual_clip` (1/c for A > 0, c for A < 0) by the constant
    `dual_clip` on -A log pi, so those tokens keep a bounded gradient. eps is `eps_low`/`eps_high` on a
    row's low-entropy tokens and `eps_low_forking`/`eps_high_forking` on its forking ones: entropy
    above the row's `entropy_quantile` quantile, under the policy being updated. The authors' values:
    0.2, 0.2, 0.4, 0.4, quantile 0.8, dual clip 3 both sides."""

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        eps_low_forking: float = 0.4,
        eps_high_forking: float = 0.4,
        entropy_quantile: float = 0.8,
        dual_clip: float = 3.0,
        **regularise,
    ):
        super().__init__(**regularise)
        for name, eps in (("eps_low", eps_low), ("eps_low_forking", eps_low_forking)):
            require(0 <= eps < 1, f"loss.{name} must be in [0, 1), got {eps}")
        for name, eps in (("eps_high", eps_high), ("eps_high_forking", eps_high_forking)):
            require(eps >= 0, f"loss.{name} must be >= 0, got {eps}")
        require(0 <= entropy_quantile <= 1, f"loss.entropy_quantile must be in [0, 1], got {entropy_quantile}")
        require(dual_clip > 1, f"loss.dual_clip must be > 1, got {dual_clip}")
        self.eps = (eps_low, eps_high, eps_low_forking, eps_high_forking)
        self.quantile, self.dual_clip = entropy_quantile, dual_clip

    def weighted_surrogate(self, x):
        forking = forking_tokens(x.entropy.detach(), x.mask, self.quantile)  # [n, Tc]
        loss, stats = self.asymmetric(x.logp, x.old_logp, x.adv, forking)
        return (loss if x.is_weight is None else loss * x.is_weight), stats

    def asymmetric(self, logp, old_logp, adv, forking):
        """The per-token loss [n, Tc] given which tokens are forking ones [n, Tc] (bool)."""
        ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # [n, Tc]
        lo, hi, lo_f, hi_f = self.eps
        neg = ratio.clamp(min=1 - torch.where(forking, lo_f, lo))  # [n, Tc] PPO's for A < 0
        pos = ratio.clamp(max=1 + torch.where(forking, hi_f, hi))  # [n, Tc] flipped for A >= 0
        neg_dual, pos_dual = neg > self.dual_clip, 1 / pos > self.dual_clip  # [n, Tc] each
        bounded = -adv * self.dual_clip * logp  # [n, Tc] the soft dual clip: weight dual_clip on -A log pi
        neg_loss = torch.where(neg_dual, bounded, -adv * neg)
        pos_loss = torch.where(pos_dual, bounded, -adv * (pos / pos.detach()) / pos.detach())
        negative = adv < 0
        clipped = torch.where(negative, neg, pos).detach()  # [n, Tc]
        return torch.where(negative, neg_loss, pos_loss), {
            "clip_frac_low": (ratio < clipped).float(),
            "clip_frac_high": (ratio > clipped).float(),
            "dual_clip_frac": torch.where(negative, neg_dual, pos_dual).float(),
            "ratio_dev": (ratio - 1).abs().detach(),
        }


def forking_tokens(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Each row's tokens whose entropy is above the row's `quantile` quantile over its own masked
    tokens (none in a row without tokens).  [n, Tc] each -> [n, Tc] bool"""
    masked = torch.where(mask.bool(), entropy.float(), torch.nan)  # [n, Tc]
    threshold = torch.nanquantile(masked, quantile, dim=-1, keepdim=True)  # [n, 1]
    return (masked > threshold) & mask.bool()


class BAPO(Regularised):
    """BAPO (Xi et al. 2025, arXiv 2510.18927, as the authors' verl recipe has it): PPO's clipped
    surrogate (dual clip 3) with its ratio bounds searched for each micro-batch, so that the positive-
    advantage tokens' clipped contribution sum(min(r, high) A) reaches `target` times the negative
    ones' sum(-max(r, low) A): `low` rises from 0.6 by `low_step` up to `low_max`, then `high` from
    1.2 by `high_step` up to `high_max`, each stopping as soon as the balance is met. Bounds are ratios,
    not epsilons; target 0.5 and the ranges [0.6, 0.9], [1.2, 3.0] are the paper's, the steps 0.05 the
    recipe's. With several processes each searches on its own micro-batch (the authors sum the two
    contributions over ranks; rlkit's processes may hold different numbers of micro-batches)."""

    def __init__(
        self,
        target: float = 0.5,
        low: float = 0.6,
        low_max: float = 0.9,
        low_step: float = 0.05,
        high: float = 1.2,
        high_max: float = 3.0,
        high_step: float = 0.05,
        dual_clip: float = 3.0,
        **regularise,
    ):
        super().__init__(**regularise)
        require(0 < low <= low_max <= 1 <= high <= high_max, "loss: need 0 < low <= low_max <= 1 <= high <= high_max")
        require(target >= 0 and low_step >= 0 and high_step >= 0, "loss.target, low_step, high_step must be >= 0")
        require(dual_clip > 1, f"loss.dual_clip must be > 1, got {dual_clip}")
        self.target, self.dual_clip = target, dual_clip
        self.low, self.high = (low, low_max, low_step), (high, high_max, high_step)

    def surrogate(self, logp, old_logp, adv, mask):
        ratio = torch.exp((logp - old_logp).detach().clamp(-20.0, 20.0))  # [n, Tc]
        low, high = self.bounds(ratio, adv, mask)
        loss, stats = clipped_surrogate(logp, old_logp, adv, 1 - low, high - 1, self.dual_clip)  # [n, Tc]
        return loss, {**stats, "clip_low": torch.full_like(ratio, low), "clip_high": torch.full_like(ratio, high)}

    def balance(self, ratio, adv, mask, low: float, high: float) -> float:
        """The positive tokens' clipped contribution over the negative ones' (inf without negative ones)."""
        effective = torch.where(adv >= 0, ratio.clamp(max=high), ratio.clamp(min=low)) * adv * mask  # [n, Tc]
        pos, neg = float(effective.clamp(min=0).sum()), float(-effective.clamp(max=0).sum())
        return math.inf if neg <= 0 else pos / (neg + 1e-8)

    def bounds(self, ratio, adv, mask) -> tuple[float, float]:
        (low, low_max, low_step), (high, high_max, high_step) = self.low, self.high
        while self.balance(ratio, adv, mask, low, high) < self.target and low < low_max and low_step > 0:
            low = min(low + low_step, low_max)
        while self.balance(ratio, adv, mask, low, high) < self.target and high < high_max and high_step > 0:
            high = min(high + high_step, high_max)
        return low, high
