"""Rollouts built by hand from tensors (no model), for testing estimators and samplers."""
import torch

from rlkit.rollout import Rollout


def make_rollout(rewards, G, lengths=None, T=4, shaping=None):
    N = len(rewards)
    lengths = lengths or [T] * N
    mask = torch.tensor([[1] * l + [0] * (T - l) for l in lengths])  # [N, T]
    z = torch.zeros(N, 1, dtype=torch.long)
    return Rollout(z, z + 1, torch.zeros(N, T, dtype=torch.long), mask, torch.zeros(N, dtype=torch.bool), G,
                   rewards=torch.tensor(rewards, dtype=torch.float),
                   shaping=None if shaping is None else torch.tensor(shaping, dtype=torch.float))
