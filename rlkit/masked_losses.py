"""Policy losses without PPO's ratio clipping (config group `loss`): GPG's plain policy gradient
and DPPO's divergence mask."""

from __future__ import annotations

import torch

from rlkit.losses import Regularised
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
