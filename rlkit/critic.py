"""The value model for estimators that need a critic (PPO + GAE): the policy's architecture with
a scalar head, started from the policy's weights, its own optimizer and a clipped value loss."""
from __future__ import annotations

import torch
from transformers import AutoModelForTokenClassification

from rlkit.rollout import Rollout, positions


def build_critic(policy) -> torch.nn.Module:
    config = policy.config.__class__.from_dict({**policy.config.to_dict(), "num_labels": 1})
    critic = AutoModelForTokenClassification.from_config(config)
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    head = critic.get_output_embeddings() if hasattr(critic, "get_output_embeddings") else None
    head = head if head is not None else critic.score
    torch.nn.init.zeros_(head.weight)  # V = 0 everywhere at the start
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return critic.to(next(policy.parameters()).device)


def token_values(critic, r: Rollout) -> torch.Tensor:
    """V of the state before each completion token (same alignment as the log-probs).  -> [N, Tc]"""
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)  # [N, S]
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1)  # [N, S]
    Tc = r.completion_ids.shape[1]
    out = critic(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits  # [N, S, 1]
    return out[:, -Tc - 1:-1, 0].float()  # [N, Tc]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token PPO value loss, clipped like the policy ratio: 0.5 max((V-R)^2, (V_clip-R)^2).  -> [N, Tc]"""
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [N, Tc]
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    var = returns[m].var()
    return float(1 - (returns[m] - values[m]).var() / var) if m.sum() > 1 and var > 0 else 0.0
