"""Policy losses (config group `loss`): per-token loss matrices [n, Tc] and their statistics.

Every loss shares the KL to a frozen reference (k1, k2, k3; in the loss or in the reward), an
entropy bonus and DAPO's overlong filtering through `Regularised`; each subclass writes only its
surrogate. PPO's clipped surrogate is GRPO's; GSPO, CISPO, SAPO, GMPO and VESPO change how the
importance ratio enters; Clip-Cov and KL-Cov act on the tokens whose advantage and log-probability
covary most. LUSPO is GSPO with `aggregator=seq_mean_token_sum` (`algo=luspo`).
"""

from __future__ import annotations

import math

import torch

from rlkit import parallel
from rlkit.components import PolicyLoss
from rlkit.refusals import require
from rlkit.tensors import seq_mean
from rlkit.types import LossInput, Rollout


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token (Schulman 2020):
    k1 = log(pi/ref), k2 = 0.5*log(pi/ref)^2, k3 = ref/pi - log(ref/pi) - 1 (>= 0)."""
    return KL_ESTIMATORS[kind](logp - ref_logp)  # [N, Tc]


KL_ESTIMATORS = {  # of the log-ratio x = log(pi/ref) [N, Tc]; `loss.kl_estimator` names one (checked by the loss)
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x**2,
    "k3": lambda x: torch.expm1(-x) + x,  # exp(-x) - 1 + x without the rounding that dips below 0
}


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """-min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A); with `dual_clip` c > 1, a negative-
    advantage token's loss is also capped at -c*A (Ye et al. 2020, arXiv 1912.09729)."""
    ratio = torch.exp(logp - old_logp)  # [N, Tc]
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)  # [N, Tc]
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)  # [N, Tc]
    with torch.no_grad():
        low, high = (ratio < 1 - eps_low) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)  # [N, Tc] each
        stats = {
            "clip_frac_low": low,
            "clip_frac_high": high,
            "clip_frac_low_of_neg": (low, adv < 0),  # the share of the tokens the lower bound can act on
            "clip_frac_high_of_pos": (high, adv > 0),  # ... and of those the upper bound can act on
            "ratio_dev": (ratio - 1).abs(),
        }
    return loss, stats


def _check_eps(eps_low: float, eps_high: float, low_max: float = 1.0) -> None:
    require(0 <= eps_low < low_max, f"loss.eps_low must be in [0, {low_max:g}), got {eps_low}")
    require(eps_high >= 0, f"loss.eps_high must be >= 0, got {eps_high}")


class EntropyCoefficient:
    """The entropy bonus's coefficient, fixed at `coef`, or adaptive when `target` is set
    (Skywork-OR1, arXiv 2505.22312; TRL `use_adaptive_entropy`): after each optimizer step it rises
    by `delta` when that step's mean entropy was <= target and falls otherwise, within [lo, hi]; it
    applies only while the last mean entropy was <= target. A checkpoint keeps its state."""

    def __init__(
        self, coef: float, target: float | None = None, delta: float = 0.005, lo: float = 0.0, hi: float = 1.0
    ):
        require(
            0 <= lo <= hi and delta >= 0,
            "loss.entropy_coef_min <= loss.entropy_coef_max and loss.entropy_coef_delta >= 0 "
            f"needed, got {lo}, {hi}, {delta}",
        )
        self.coef, self.target, self.delta, self.range, self.last = coef, target, delta, (lo, hi), float("inf")

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def value(self) -> float:
        """The coefficient the next step applies."""
        return 0.0 if self.adaptive and self.last > self.target else self.coef

    def update(self, entropy: float) -> None:
        """After a step with mean entropy `entropy` (every process's tokens)."""
        step = self.delta if entropy <= self.target else -self.delta
        self.coef, self.last = min(max(self.coef + step, self.range[0]), self.range[1]), entropy

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_entropy": self.last}

    def load_state_dict(self, state: dict) -> None:
        if state:  # a checkpoint from before the loss kept state has none
            self.coef, self.last = state["entropy_coef"], state["last_entropy"]


class Regularised(PolicyLoss):
    """What every loss can add to its surrogate: `beta` times a KL estimate to the reference, in
    the loss (GRPO) or subtracted from the per-token reward (PPO, RLOO); an entropy bonus; and
    `drop_truncated` (DAPO's overlong filtering: completions that hit the budget get no loss).

    Options the peers ship: `kl_is_weighted` multiplies the KL term by pi_theta / pi_old (with
    its gradient), the importance-weighted KL whose gradient is the reverse KL's under off-policy
    samples (DeepSeek-V3.2, arXiv 2512.02556; TRL `use_bias_correction_kl`).
    `top_entropy_quantile` rho < 1 keeps the policy term and the entropy bonus only on the
    rollout's tokens whose entropy is at or above its (1 - rho) quantile (Wang et al. 2025, arXiv
    2506.01939: the high-entropy "forking" 20%; TRL `top_entropy_quantile`); the threshold is taken
    over the whole rollout under the policy that generated it, so every micro-batch split selects
    the same tokens. `entropy_target` (not null) makes the entropy coefficient adaptive
    (Skywork-OR1, arXiv 2505.22312; TRL `use_adaptive_entropy`): after each optimizer step the
    coefficient rises by `entropy_coef_delta` when that step's mean entropy was <= target and falls
    otherwise, within [entropy_coef_min, entropy_coef_max]; it applies only while the last mean
    entropy was <= target, and starts at `entropy_coef`. `positive_nll` mu > 0 adds mu times the
    negative log-likelihood of every token of a row whose reward is positive (VAPO's positive-sample
    NLL, arXiv 2504.05118, mu 0.1; NeMo RL), normalised by the aggregator like the rest of the loss."""

    def __init__(
        self,
        beta: float = 0.0,
        kl_estimator: str = "k3",
        kl_placement: str = "loss",
        entropy_coef: float = 0.0,
        drop_truncated: bool = False,
        kl_is_weighted: bool = False,
        top_entropy_quantile: float = 1.0,
        entropy_target: float | None = None,
        entropy_coef_delta: float = 0.005,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        positive_nll: float = 0.0,
    ):
        require(beta >= 0, f"loss.beta must be >= 0, got {beta}")
        require(positive_nll >= 0, f"loss.positive_nll must be >= 0, got {positive_nll}")
        require(kl_estimator in KL_ESTIMATORS, f"loss.kl_estimator must be one of k1, k2, k3, got {kl_estimator!r}")
        require(
            kl_placement in ("loss", "reward"), f"loss.kl_placement must be 'loss' or 'reward', got {kl_placement!r}"
        )
        require(
            0 < top_entropy_quantile <= 1, f"loss.top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}"
        )
        self.beta, self.kl_estimator = beta, kl_estimator
        self.entropy_control = EntropyCoefficient(
            entropy_coef, entropy_target, entropy_coef_delta, entropy_coef_min, entropy_coef_max
        )
        self.kl_in_reward = beta > 0 and kl_placement == "reward"
        self.entropy_grad = entropy_coef != 0 or entropy_target is not None
        self.drop_truncated, self.kl_is_weighted = drop_truncated, kl_is_weighted
        self.top_entropy_quantile, self.selects_tokens = top_entropy_quantile, top_entropy_quantile < 1
        self.positive_nll = positive_nll

    def surrogate(self, logp, old_logp, adv, mask) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def weighted_surrogate(self, x: LossInput) -> tuple[torch.Tensor, dict]:
        """The surrogate times the off-policy correction's weights (None: no correction)."""
        loss, stats = self.surrogate(x.logp, x.old_logp, x.adv, x.mask)  # [n, Tc]
        return (loss if x.is_weight is None else loss * x.is_weight), stats

    def __call__(self, x: LossInput) -> tuple[torch.Tensor, dict]:
        """The per-token loss [n, Tc] and its statistics: the weighted surrogate on the selected
        tokens, plus the KL term (unless it sits in the reward), minus the entropy bonus."""
        loss, stats = self.weighted_surrogate(x)  # [n, Tc]
        if x.select is not None:
            loss = loss * x.select
        if self.positive_nll and x.reward is not None:
            loss = loss - self.positive_nll * x.logp * (x.reward > 0)[:, None]  # [n, Tc]
        if x.ref_logp is not None:
            kl = kl_estimate(x.logp, x.ref_logp, self.kl_estimator)  # [n, Tc]
            stats["kl"] = kl.detach()
            if not self.kl_in_reward:
                loss = loss + self.beta * (kl * torch.exp(x.logp - x.old_logp) if self.kl_is_weighted else kl)
        coef = self.current_entropy_coef()
        if x.entropy is not None and coef:
            loss = loss - coef * (x.entropy if x.select is None else x.entropy * x.select)
        return loss, stats  # [n, Tc]

    @property
    def entropy_coef(self) -> float:
        return self.entropy_control.coef

    def current_entropy_coef(self) -> float:
        return self.entropy_control.value()

    def end_step(self, entropy_sums: torch.Tensor) -> None:
        """After an optimizer step whose selected tokens had entropy sum and count `entropy_sums` [2]
        on this process: the adaptive coefficient's update, on every process's tokens."""
        if self.entropy_control.adaptive:
            total, count = parallel.total(entropy_sums).tolist()
            self.entropy_control.update(total / max(count, 1.0))

    def state_dict(self) -> dict:
        return self.entropy_control.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.entropy_control.load_state_dict(state)

    def token_selection(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The top-entropy tokens of the rollout (None when every token counts).  [N, Tc] -> [N, Tc]"""
        if not self.selects_tokens:
            return None
        values = torch.cat(parallel.gather(entropy[mask.bool()].float().cpu()))  # every rank's tokens
        if not len(values):
            return torch.zeros_like(mask)
        threshold = torch.quantile(values, 1 - self.top_entropy_quantile)
        return ((entropy * mask >= threshold) & mask.bool()).float()

    def kl_penalty(self, old_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        return self.beta * kl_estimate(old_logp, ref_logp, self.kl_estimator)  # [N, Tc]

    def train_mask(self, rollout: Rollout) -> torch.Tensor:
        mask = rollout.action_mask.float()  # [N, Tc] the model's own tokens
        return mask * (~rollout.truncated)[:, None] if self.drop_truncated else mask


class PPOClip(Regularised):
    """PPO's clipped surrogate as GRPO uses it (arXiv 1707.06347, 2402.03300), per token:
    -min(r A, clip(r, 1-eps_low, 1+eps_high) A), with DAPO's clip-higher (eps_high 0.28, arXiv
    2503.14476) and an optional dual clip."""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None, **regularise):
        super().__init__(**regularise)
        _check_eps(eps_low, eps_high)
        require(dual_clip is None or dual_clip > 1, f"loss.dual_clip must be > 1 or null, got {dual_clip}")
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
        log_s, seq_adv = seq_mean(logp - old_logp, mask)[:, 0], seq_mean(adv, mask)[:, 0]  # [n] each
        loss, stats = clipped_surrogate(log_s, torch.zeros_like(log_s), seq_adv, self.eps_low, self.eps_high)  # [n]
        spread = lambda v: v[:, None].float() * mask  # noqa: E731  [n] -> [n, Tc]
        stats = {k: tuple(map(spread, v)) if isinstance(v, tuple) else spread(v) for k, v in stats.items()}
        return loss[:, None] * mask, stats  # [n, Tc]


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
        stats = {
            "clip_frac_low": ratio < 1 - self.eps_low,
            "clip_frac_high": ratio > 1 + self.eps_high,
            "ratio_dev": (ratio - 1).abs(),
        }
        return -weight * adv * logp, stats  # [n, Tc]


class SAPO(Regularised):
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate instead of the
    hard clip, -(4/tau) sigmoid(tau (r - 1)) A, with tau_pos for A > 0 and tau_neg otherwise.
    Its gradient at r = 1 equals PPO's; away from 1 it fades smoothly instead of dropping to 0.
    `gate` logs the gradient's weight relative to PPO's, 4 s (1 - s) with s the sigmoid."""

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05, **regularise):
        super().__init__(**regularise)
        require(tau_pos > 0 and tau_neg > 0, f"loss.tau_pos and loss.tau_neg must be > 0, got {tau_pos} and {tau_neg}")
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def surrogate(self, logp, old_logp, adv, mask):
        ratio = torch.exp(logp - old_logp)  # [n, Tc]
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg)  # [n, Tc]
        gate = torch.sigmoid(tau * (ratio - 1))  # [n, Tc]
        stats = {"ratio_dev": (ratio - 1).abs().detach(), "gate": (4 * gate * (1 - gate)).detach()}
        return -(4 / tau) * gate * adv, stats  # [n, Tc]


class VESPO(Regularised):
    """VESPO (arXiv 2602.10693, as TRL 1.16 implements it): no clip; each sequence's policy
    gradient is scaled by a Gamma-shaped weight of its importance ratio, -phi(w) A log pi_theta,
    phi(w) = exp(lambda) w^k exp(-lambda w) (phi(1) = 1, no gradient), w = prod_t pi_theta/pi_old
    times the off-policy correction's weights (folded into w, not multiplied after). (k, lambda)
    = (k_pos, lambda_pos) for A >= 0, (k_neg, lambda_neg) otherwise; log-ratios clamped to
    [-20, 20] and log w to [log 1e-8, 20] as TRL. Pair with `aggregator=token_mean` (TRL's)."""

    def __init__(
        self, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0, **regularise
    ):
        super().__init__(**regularise)
        self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg = k_pos, lambda_pos, k_neg, lambda_neg

    def weighted_surrogate(self, x: LossInput):
        """The correction's weights enter each sequence's importance ratio w, not the product."""
        low, logp, adv, mask = math.log(1e-8), x.logp, x.adv, x.mask
        with torch.no_grad():
            log_w = ((logp - x.old_logp).clamp(-20, 20) * mask).sum(-1, keepdim=True)  # [n, 1]
            if x.is_weight is not None:
                log_w = log_w + (torch.log(x.is_weight).clamp(low, 20) * mask).sum(-1, keepdim=True)
            log_w = log_w.clamp(low, 20)  # [n, 1]
            pos = seq_mean(adv, mask) >= 0  # [n, 1]
            k = torch.where(pos, self.k_pos, self.k_neg)  # [n, 1]
            lam = torch.where(pos, self.lambda_pos, self.lambda_neg).clamp(min=1e-4)  # [n, 1]
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)  # [n, 1]
        return -phi * adv * logp, {"phi": phi.expand_as(mask)}  # [n, Tc]

    def surrogate(self, logp, old_logp, adv, mask):
        return self.weighted_surrogate(LossInput(logp, old_logp, adv, mask))


class GMPO(Regularised):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl `geo_mean`): the geometric mean of the token
    ratios instead of their arithmetic mean, each log-ratio clipped at token level in a wider range:
    -A_i exp(mean_t sgn(A) min(sgn(A) l_t, sgn(A) clip(l_t, -eps_low, eps_high))), l_t = log
    pi_theta/pi_old, A_i the sequence's mean token advantage. The per-sequence loss is placed on each
    of its tokens, so `aggregator=seq_mean_token_mean` gives the paper's mean over sequences. Clip
    range (e^-0.4, e^0.4) as the paper."""

    def __init__(self, eps_low: float = 0.4, eps_high: float = 0.4, **regularise):
        super().__init__(**regularise)
        _check_eps(eps_low, eps_high, low_max=float("inf"))
        self.eps_low, self.eps_high = eps_low, eps_high

    def surrogate(self, logp, old_logp, adv, mask):
        log_ratio = logp - old_logp  # [n, Tc]
        sign = torch.sign(adv)  # [n, Tc]
        clamped = log_ratio.clamp(-self.eps_low, self.eps_high)  # [n, Tc]
        kept = sign * torch.min(sign * log_ratio, sign * clamped)  # [n, Tc]
        ratio = torch.exp(seq_mean(kept, mask))  # [n, 1]
        clipped = (log_ratio != clamped).detach()
        stats = {
            "clip_frac_low": clipped & (adv < 0),
            "clip_frac_high": clipped & (adv > 0),
            "ratio_dev": (ratio.detach() - 1).abs().expand_as(mask),
        }
        return (-seq_mean(adv, mask) * ratio).expand_as(mask) * mask, stats  # [n, Tc]


def centred_cov(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's term of the covariance between advantage and log-probability over the masked
    tokens, (A - mean A)(log pi - mean log pi), no gradient.  -> [n, Tc]"""
    m = mask.bool()
    lp = logp.detach()
    return (adv - adv[m].mean()) * (lp - lp[m].mean())


class ClipCov(PPOClip):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617; verl `clip_cov`): PPO's clipped surrogate, and a
    random `clip_cov_ratio` share of the tokens (at least one) whose covariance term lies in
    (clip_cov_lb, clip_cov_ub) and whose ratio is not already clipped lose their gradient, which
    slows the entropy collapse those high-covariance tokens drive. Like verl, the covariance and
    the selection are computed over the tokens of one forward (the micro-batch)."""

    def __init__(self, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, **ppo):
        super().__init__(**ppo)
        require(
            0 < clip_cov_ratio <= 1 and clip_cov_lb < clip_cov_ub,
            f"loss.clip_cov_ratio must be in (0, 1] and clip_cov_lb < clip_cov_ub, got "
            f"{clip_cov_ratio}, {clip_cov_lb}, {clip_cov_ub}",
        )
        self.ratio, self.lb, self.ub = clip_cov_ratio, clip_cov_lb, clip_cov_ub

    def surrogate(self, logp, old_logp, adv, mask):
        loss, stats = super().surrogate(logp, old_logp, adv, mask)  # [n, Tc]
        ratio = torch.exp(logp - old_logp).detach()  # [n, Tc]
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * -adv > ratio * -adv  # [n, Tc]
        cov = centred_cov(adv, logp, mask)  # [n, Tc]
        candidates = ((cov > self.lb) & (cov < self.ub) & mask.bool() & ~clipped).nonzero()  # [c, 2]
        n = max(int(self.ratio * float(mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates))[:n]]  # [<=n, 2]
        keep = torch.ones_like(loss)
        keep[chosen[:, 0], chosen[:, 1]] = 0
        return loss * keep, {**stats, "cov_detached": 1 - keep}


class KLCov(Regularised):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617; verl `kl_cov`): the unclipped surrogate -r A, and on
    the `kl_cov_ratio` share of tokens (at least one) with the largest covariance term an added
    penalty `kl_coef` |log pi_theta - log pi_old|. Like verl, over the tokens of one forward."""

    def __init__(self, kl_cov_ratio: float = 2e-4, kl_coef: float = 1.0, **regularise):
        super().__init__(**regularise)
        require(
            0 < kl_cov_ratio <= 1 and kl_coef >= 0,
            f"loss.kl_cov_ratio must be in (0, 1] and loss.kl_coef >= 0, got {kl_cov_ratio}, {kl_coef}",
        )
        self.ratio, self.kl_coef = kl_cov_ratio, kl_coef

    def surrogate(self, logp, old_logp, adv, mask):
        log_ratio = logp - old_logp  # [n, Tc]
        loss = -adv * torch.exp(log_ratio)  # [n, Tc]
        m = mask.bool()
        picked = torch.zeros_like(mask)
        if m.any():
            cov = centred_cov(adv, logp, mask)[m]  # [valid]
            top = torch.topk(cov, max(1, int(len(cov) * self.ratio))).indices
            flat = torch.zeros_like(cov)
            flat[top] = 1
            picked[m] = flat
        loss = loss + picked * self.kl_coef * log_ratio.abs()
        return loss, {"kl_cov_penalised": picked, "ratio_dev": (torch.exp(log_ratio.detach()) - 1).abs()}
