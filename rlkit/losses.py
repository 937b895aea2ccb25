"""Per-token policy loss: PPO clipped surrogate (clip-higher, dual clip), KL to a reference
(k1, k2, k3) and an entropy bonus. Everything here is [N, Tc] -> [N, Tc]."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float,
                      eps_high: float, dual_clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """-min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A); with `dual_clip` c > 1, a negative-
    advantage token's loss is also capped at -c*A (Ye et al. 2020, arXiv 1912.09729)."""
    ratio = torch.exp(logp - old_logp)  # [N, Tc]
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)  # [N, Tc]
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)  # [N, Tc]
    with torch.no_grad():
        info = {"clip_low": (ratio < 1 - eps_low) & (adv < 0), "clip_high": (ratio > 1 + eps_high) & (adv > 0),
                "ratio": ratio.detach()}
    return loss, info


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


@dataclass
class PolicyLoss:
    """The per-token loss of one micro-batch; `cfg` is the `loss` config node."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_placement: str = "loss"
    entropy_coef: float = 0.0

    def __call__(self, logp, old_logp, adv, ref_logp=None, entropy=None) -> tuple[torch.Tensor, dict]:
        loss, info = clipped_surrogate(logp, old_logp, adv, self.eps_low, self.eps_high, self.dual_clip)
        if ref_logp is not None:
            kl = kl_estimate(logp, ref_logp, self.kl_estimator)  # [N, Tc]
            info["kl"] = kl.detach()
            if self.kl_placement == "loss":
                loss = loss + self.beta * kl
        if entropy is not None and self.entropy_coef:
            loss = loss - self.entropy_coef * entropy
        return loss, info  # [N, Tc]
