"""Off-policy corrections (config group `correction`): per-token weights on the policy loss for
rollouts the trainer did not sample itself, a stale engine (an asynchronous pipeline) or one
whose numbers differ (a bf16 or vLLM engine).

Notation: mu the behaviour policy (the engine's log-probs, `behaviour_logp`), pi_old the trainer's
policy when the rollout was made (`old_logp`, recomputed by the trainer: the proximal policy of
decoupled PPO), pi_theta the policy being updated (`logp`). The clipped surrogate keeps using
pi_theta / pi_old; a correction multiplies each token's policy loss by a weight built from
rho_t = pi_old(y_t) / mu(y_t). An engine whose numbers are the trainer's gives mu = pi_old, so
rho = 1 and every correction below gives weight 1 (and keeps every sequence, for the mask, at
the first update of a rollout).
"""

from __future__ import annotations

import torch

from rlkit.components import Correction
from rlkit.refusals import require
from rlkit.tensors import seq_mean


def _bounds(c_min: float, c_max: float | None) -> None:
    require(0 <= c_min <= 1, f"correction.c_min must be in [0, 1], got {c_min}")
    require(c_max is None or c_max >= 1, f"correction.c_max must be >= 1 or null, got {c_max}")


def _outside(rho: torch.Tensor, c_min: float, c_max: float | None) -> torch.Tensor:
    return (rho < c_min) | (rho > c_max) if c_max is not None else rho < c_min


class NoCorrection(Correction):
    """No weight: the loss treats the rollout as the trainer's own (on-policy PPO's assumption)."""

    def __call__(self, logp, old_logp, behaviour_logp, adv, mask):
        return torch.ones_like(old_logp), {}  # [n, Tc]


class TokenTIS(Correction):
    """Truncated importance sampling per token (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; TRL `token_truncate`): w_t = clip(rho_t, c_min,
    c_max). The truncation bounds the variance at the cost of a bias where rho_t > c_max."""

    def __init__(self, c_max: float = 2.0, c_min: float = 0.0):
        _bounds(c_min, c_max)
        self.c_min, self.c_max = c_min, c_max

    def __call__(self, logp, old_logp, behaviour_logp, adv, mask):
        rho = torch.exp(old_logp - behaviour_logp)  # [n, Tc]
        return rho.clamp(self.c_min, self.c_max), {"is_clipped": _outside(rho, self.c_min, self.c_max).float()}


class TokenMIS(Correction):
    """Masked importance sampling per token (IcePop, Ling team 2025; TRL `token_mask`): w_t = rho_t
    where c_min <= rho_t <= c_max, else 0: a token the engines disagree on too much gets no
    gradient at all, instead of a truncated one. Bounds [0.5, 5] as IcePop."""

    def __init__(self, c_min: float = 0.5, c_max: float | None = 5.0):
        _bounds(c_min, c_max)
        self.c_min, self.c_max = c_min, c_max

    def __call__(self, logp, old_logp, behaviour_logp, adv, mask):
        rho = torch.exp(old_logp - behaviour_logp)  # [n, Tc]
        out = _outside(rho, self.c_min, self.c_max)  # [n, Tc]
        return rho.masked_fill(out, 0.0), {"is_masked": out.float()}


class SequenceIS(Correction):
    """One weight per sequence from its token ratios, on every token of it: `mode` truncate
    (clip to [c_min, c_max]) or mask (0 outside). `level` geometric: rho_seq = exp(mean_t log
    rho_t), the geometric mean, comparable across lengths; product: exp(sum_t log rho_t), the
    sequence's true likelihood ratio (TRL's `sequence_truncate` / `sequence_mask`), whose spread
    grows with length. Bounds [0.5, 2] are ours for the geometric mean."""

    def __init__(self, mode: str = "truncate", level: str = "geometric", c_min: float = 0.5, c_max: float | None = 2.0):
        require(mode in ("truncate", "mask"), f"correction.mode must be 'truncate' or 'mask', got {mode!r}")
        require(level in ("geometric", "product"), f"correction.level must be 'geometric' or 'product', got {level!r}")
        _bounds(c_min, c_max)
        self.mode, self.level, self.c_min, self.c_max = mode, level, c_min, c_max

    def __call__(self, logp, old_logp, behaviour_logp, adv, mask):
        log_rho = (old_logp - behaviour_logp) * mask  # [n, Tc]
        log_seq = seq_mean(log_rho, mask) if self.level == "geometric" else log_rho.sum(-1, keepdim=True)  # [n, 1]
        rho = torch.exp(log_seq)  # [n, 1]
        out = _outside(rho, self.c_min, self.c_max)  # [n, 1]
        w = rho.clamp(self.c_min, self.c_max) if self.mode == "truncate" else rho.masked_fill(out, 0.0)  # [n, 1]
        return w.expand_as(mask).clone(), {"is_seq_outside": out.float().expand_as(mask)}  # [n, Tc]


class OffPolicySequenceMask(Correction):
    """DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, Eq. 9; TRL
    `off_policy_mask_threshold`): a sequence with a negative advantage whose mean per-token
    log(mu / pi_theta) exceeds `delta` gets no loss; every other sequence keeps weight 1. The
    advantage of a sequence is the mean of its token advantages (one value under GRPO). Measured
    against the policy being updated, so it also acts on the later mini-batches of an on-policy
    rollout. delta 0.5 as TRL's example."""

    def __init__(self, delta: float = 0.5):
        require(delta >= 0, f"correction.delta must be >= 0, got {delta}")
        self.delta = delta

    def __call__(self, logp, old_logp, behaviour_logp, adv, mask):
        kl = seq_mean(behaviour_logp - logp.detach(), mask)  # [n, 1]
        drop = (seq_mean(adv, mask) < 0) & (kl > self.delta)  # [n, 1]
        return (~drop).float().expand_as(mask).clone(), {"seq_masked": drop.float().expand_as(mask)}  # [n, Tc]


class SecondMomentMask(Correction):
    """M2PO (Zheng et al. 2025, arXiv 2510.01161; AReaL `m2_threshold`): the tokens with the largest
    squared log-ratio (log pi_old - log mu)^2 are masked out (weight 0), largest first, until the
    mean over the tokens kept is below `threshold`; every other token keeps weight 1 (at least one
    is kept). Only extreme outliers of a stale or lower-precision engine lose their gradient, so
    the second moment of the importance weights stays bounded. Taken over each micro-batch, as
    AReaL does; 0.04 as its example."""

    def __init__(self, threshold: float = 0.04):
        require(threshold > 0, f"correction.threshold must be > 0, got {threshold}")
        self.threshold = threshold

    def __call__(self, logp, old_logp, behaviour_logp, adv, mask):
        m2 = ((old_logp - behaviour_logp) ** 2)[mask.bool()]  # [k] the masked tokens'
        ordered, order = m2.sort(descending=True)  # [k] each
        counts = torch.arange(len(m2), 0, -1, dtype=m2.dtype, device=m2.device)  # [k] tokens from each index on
        below = (ordered.flip(0).cumsum(0).flip(0) / counts < self.threshold).nonzero()  # [j, 1]
        drop = int(below[0]) if len(below) else max(len(m2) - 1, 0)  # the largest `drop` go
        kept = torch.ones_like(m2, dtype=torch.bool)  # [k]
        kept[order[:drop]] = False
        weights = torch.zeros_like(old_logp)  # [n, Tc]
        weights[mask.bool()] = kept.to(weights.dtype)
        return weights, {"m2_masked": (weights == 0).float() * mask}
