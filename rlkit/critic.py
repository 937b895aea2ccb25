"""The value model for estimators that need a critic (PPO + GAE): the policy's architecture with
a scalar head, started from the policy's weights, its own optimizer and a clipped value loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForTokenClassification

from rlkit import parallel
from rlkit.components import Critic
from rlkit.refusals import require
from rlkit.tensors import trimmed_inputs
from rlkit.types import Rollout


def build_critic(policy) -> torch.nn.Module:
    # no dropout before the value head (token-classification heads default to 0.1): values are deterministic
    config = policy.config.__class__.from_dict({**policy.config.to_dict(), "num_labels": 1, "classifier_dropout": 0.0})
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
    ids, mask, pos, tc = trimmed_inputs(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    out = critic(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # [N, S', 1]
    return F.pad(out[:, -tc - 1 : -1, 0].float(), (0, r.completion_ids.shape[1] - tc))  # [N, Tc]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token PPO value loss, clipped like the policy ratio: 0.5 max((V-R)^2, (V_clip-R)^2).  -> [N, Tc]"""
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [N, Tc]
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    var = returns[m].var()
    return float(1 - (returns[m] - values[m]).var() / var) if m.sum() > 1 and var > 0 else 0.0


class ValueModel(Critic):
    """A token-level value model started from the policy (`build_critic`), trained by AdamW with
    the clipped value loss on the same mini-batches as the policy."""

    def __init__(self, policy, max_grad_norm: float, lr: float = 1e-3, value_clip: float = 0.2):
        require(lr > 0 and value_clip > 0, f"critic.lr and critic.value_clip must be > 0, got {lr} and {value_clip}")
        self.model = build_critic(policy)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.value_clip, self.max_grad_norm = value_clip, max_grad_norm

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        return token_values(self.model, rollout)  # [N, Tc]

    def fit(self, rollout: Rollout, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        values = token_values(self.model, rollout)  # [n, Tc]
        vl = value_loss(values, old_values, returns, self.value_clip)  # [n, Tc]
        vl = (vl * mask).sum() / parallel.total(mask.sum()).clamp(min=1)  # mean over every rank's tokens
        vl.backward()
        parallel.sum_gradients(self.model.parameters())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(parallel.total(vl.detach()))

    def save(self, path) -> None:
        self.model.save_pretrained(path)

    def load(self, path) -> None:
        self.model.load_state_dict(type(self.model).from_pretrained(path).state_dict())

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
