"""Per-step rollout statistics (what the variant studies compare). A statistic of an empty subset
(the length of correct answers on a step with none) is missing, None, never 0: loggers leave it
out, so means over steps and "final" values never mix lengths with zeros."""

from __future__ import annotations

import torch

from rlkit.tensors import flat, seq_mean
from rlkit.types import Rollout, UpdateStats


def mean_or_none(x: torch.Tensor) -> float | None:
    return float(x.float().mean()) if x.numel() else None


def std_or_none(x: torch.Tensor) -> float | None:
    return float(x.float().std()) if x.numel() > 1 else None


def right(r: Rollout) -> torch.Tensor:
    """Which answers are right: the rollout's `correct` (the task's score), else reward > 0.  -> [N] bool"""
    return r.correct if r.correct is not None else r.rewards > 0


def rollout_metrics(r: Rollout, adv: torch.Tensor) -> dict:
    """Reward, group, length and advantage statistics of one rollout; adv is [N, Tc]."""
    if r.rewards.numel() == 0:
        return {"train/num_rows": 0}
    rewards = r.rewards.float()  # [N]
    groups = rewards.view(-1, r.group_size)  # [P, G]
    lengths = r.lengths.float()  # [N]
    correct = right(r)  # [N]
    mask = r.action_mask.bool()  # [N, Tc] the model's tokens
    seq_adv = seq_mean(adv, mask)[:, 0]  # [N]
    return {
        "train/reward": mean_or_none(rewards),
        "train/reward_std": std_or_none(rewards),
        "train/frac_zero_std_groups": mean_or_none(flat(groups)),
        "train/frac_all_correct_groups": mean_or_none(correct.view(-1, r.group_size).all(1)),
        "train/frac_all_wrong_groups": mean_or_none((~correct).view(-1, r.group_size).all(1)),
        "train/completion_len": mean_or_none(lengths),
        "train/len_correct": mean_or_none(lengths[correct]),
        "train/len_incorrect": mean_or_none(lengths[~correct]),
        "train/truncated_frac": mean_or_none(r.truncated),
        "train/adv_mean": mean_or_none(adv[mask]),
        "train/adv_std": std_or_none(adv[mask]),
        "train/frac_zero_adv_groups": mean_or_none((seq_adv.view(-1, r.group_size) == 0).all(1)),
        "train/num_rows": int(rewards.numel()),
        **by_difficulty(r.rows, correct.float(), "train/acc"),
    }


def reward_metrics(r: Rollout, names: list[str]) -> dict:
    """Each reward function's mean score, as `reward/<name>`."""
    if r.reward_parts is None or not r.num_rows:
        return {}
    return {f"reward/{n}": float(r.reward_parts[:, k].float().mean()) for k, n in enumerate(names)}


def difficulties(rows: list[dict]) -> torch.Tensor | None:
    """Each row's `difficulty` (a task column, e.g. the number of terms), or None when the task has none.  -> [N]"""
    if not rows or "difficulty" not in rows[0]:
        return None
    return torch.tensor([float(r["difficulty"]) for r in rows])


def by_difficulty(rows: list[dict], values: torch.Tensor, name: str, reduce=mean_or_none) -> dict:
    """`name` + `_d<k>` for each difficulty k: `reduce` of the values of its rows.  values: [N]"""
    d = difficulties(rows)
    if d is None:
        return {}
    return {f"{name}_d{k:g}": reduce(values[d == k]) for k in d.unique().tolist()}  # 3.0 -> _d3, 1.5 -> _d1.5


def hardest_third(rows: list[dict], values: torch.Tensor, name: str) -> dict:
    """`name` + `_hard`: the mean of `values` over the rows of the hardest third of the difficulty
    levels present (rounded up: with levels 2-8, levels 6-8). For a fixed set of rows, such as the
    held-out split, so the same prompts count at every evaluation.  values: [N]"""
    d = difficulties(rows)
    if d is None:
        return {}
    levels = d.unique()  # sorted
    hard = d >= levels[-((len(levels) + 2) // 3)]  # [N]
    return {f"{name}_hard": mean_or_none(values[hard])}


def feature_metrics(task, rows: list[dict], texts: list[str], prefix: str, hard: bool = False) -> dict:
    """The task's own per-completion features (`task.features(completion) -> {name: value}`, e.g.
    arithmetic's `worked`: the answer shows its steps), each as `<prefix>/<name>`: the mean overall,
    per difficulty level and, with `hard` (a fixed set of rows), over the hardest third. {} for a
    task without features."""
    if not texts or task.features is None:
        return {}
    feats = [task.features(t) for t in texts]
    out = {}
    for name in feats[0]:
        v = torch.tensor([float(f[name]) for f in feats])  # [N]
        key = f"{prefix}/{name}"
        out.update(
            {key: mean_or_none(v), **by_difficulty(rows, v, key), **(hardest_third(rows, v, key) if hard else {})}
        )
    return out


def kept_metrics(task, reward_names: list[str], r: Rollout, adv: torch.Tensor) -> dict:
    """The statistics of the rollout trained on: rewards, lengths, advantages, the task's features
    and each reward term."""
    return {
        **rollout_metrics(r, adv),
        **feature_metrics(task, r.rows, r.texts, "train"),
        **reward_metrics(r, reward_names),
    }


def weight_metrics(r: Rollout, adv: torch.Tensor, weights: torch.Tensor) -> dict:
    """Effective per-token weight (advantage x aggregator weight): summed over correct and over
    incorrect completions, and its mean magnitude per token for short and long completions
    (split at the median length). This is where GRPO's length bias shows."""
    eff = adv * weights  # [N, Tc]
    per_seq = eff.sum(-1)  # [N]
    correct = right(r)  # [N]
    lengths = r.lengths.float()  # [N]
    short = lengths <= lengths.median()  # [N]
    mask = r.action_mask.bool()  # [N, Tc] the model's tokens
    magnitude = eff.abs().sum(-1)  # [N]

    def per_token(rows: torch.Tensor) -> float | None:  # mean |weight| over the tokens of `rows` [N] bool
        return mean_or_none(eff[rows][mask[rows]].abs())

    def share(x: torch.Tensor) -> float | None:  # x's part of the total magnitude
        return float(x.sum() / magnitude.sum()) if magnitude.sum() > 0 else None

    return {
        "weight/correct_sum": float(per_seq[correct].sum()),
        "weight/incorrect_sum": float(per_seq[~correct].sum()),
        "weight/short_token_mean": per_token(short),
        "weight/long_token_mean": per_token(~short),
        **by_difficulty(r.rows, magnitude, "weight/share", share),
    }


def samples(r: Rollout, adv: torch.Tensor, per_group: int = 2, groups: int = 8) -> list[dict]:
    """A few completions with their rewards and mean advantages, for a table of samples."""
    mask = r.action_mask.bool()  # [N, Tc] the model's tokens
    seq_adv = seq_mean(adv, mask)[:, 0]  # [N]
    rows = [g * r.group_size + i for g in range(min(groups, r.num_groups)) for i in range(min(per_group, r.group_size))]
    return [
        {
            "prompt": r.rows[i]["prompt"],
            "completion": r.texts[i],
            "reward": float(r.rewards[i] + r.shaping[i]),
            "advantage": float(seq_adv[i]),
        }
        for i in rows
    ]


@torch.no_grad()
def mismatch_metrics(
    old_logp: torch.Tensor | None,
    behaviour_logp: torch.Tensor | None,
    mask: torch.Tensor,
    c_min: float = 0.5,
    c_max: float | None = 2.0,
) -> dict:
    """How far the engine's sampling distribution mu is from the trainer's pi_old on the sampled
    tokens: k3 estimate of KL(mu || pi_old) (r - 1 - log r with r = pi_old/mu, samples from mu),
    the ratio's mean, min, max and its 5%, 50% and 95% quantiles, the mean log r and mean |log r|,
    and the share of tokens with r outside [c_min, c_max] (c_max None: no upper bound). When the
    engine's numbers are the trainer's: k3, log r and the share outside are 0 and every ratio is 1.
    No masked token, or no log-probs of either side (None): no metric (an empty dict), not zeros."""
    if old_logp is None or behaviour_logp is None:
        return {}
    m = mask.bool()
    log_r = (old_logp - behaviour_logp)[m]  # [tokens]
    if not len(log_r):
        return {}
    r, hi = torch.exp(log_r), float("inf") if c_max is None else c_max
    return {
        "offpolicy/k3": float((torch.expm1(log_r) - log_r).mean()),
        "offpolicy/ratio_mean": float(r.mean()),
        "offpolicy/ratio_min": float(r.min()),
        "offpolicy/ratio_max": float(r.max()),
        "offpolicy/abs_log_ratio": float(log_r.abs().mean()),
        "offpolicy/log_ratio_mean": float(log_r.mean()),
        **{
            f"offpolicy/ratio_p{q:02d}": float(v)
            for q, v in zip((5, 50, 95), r.quantile(r.new_tensor([0.05, 0.5, 0.95])))
        },
        "offpolicy/outside_frac": float(((r < c_min) | (r > hi)).float().mean()),
    }


def generated_metrics(env, rollouts: list[Rollout]) -> dict:
    """What the step generated, kept or not: its completion tokens (`train/gen_tokens`), its mean
    reward (`train/reward_all`) and, in a multi-turn environment, the model's own tokens per episode
    (`env/model_tokens`) and the environment's metrics of every episode (`env/...`)."""
    out = {
        "train/gen_tokens": sum(int(r.completion_mask.sum()) for r in rollouts),
        "train/reward_all": mean_or_none(torch.cat([r.rewards for r in rollouts])),
    }
    played = [e for r in rollouts for e in r.episodes]
    if played:
        correct = torch.cat([right(r) for r in rollouts])  # [N]
        out["env/model_tokens"] = float(torch.cat([r.action_mask.sum(-1) for r in rollouts]).float().mean())
        out.update({f"env/{k}": v for k, v in env.metrics(played, correct).items()})
    return out


def update_metrics(stats: UpdateStats) -> dict:
    """The update's statistics: each loss statistic's token mean (over its own tokens when it has a
    `within`; none over zero tokens) and the mean loss and gradient norm over its optimizer steps
    (none when it was skipped), and the critic's mean value loss."""
    out = {}
    if not stats.skipped:
        if stats.tokens:
            counts = {k: stats.counts.get(k, stats.tokens) for k in stats.sums}
            out = {f"train/{k}": v / counts[k] if counts[k] else None for k, v in stats.sums.items()}
        if stats.losses:
            out["train/loss"] = sum(stats.losses) / len(stats.losses)
            out["train/grad_norm"] = sum(stats.grad_norms) / len(stats.grad_norms)
    if stats.value_losses:
        out["train/value_loss"] = sum(stats.value_losses) / len(stats.value_losses)
    return out
