"""The critic: starts from the policy, predicts 0, clipped value loss by hand, explained variance."""

import pytest
import torch

from rlkit.critic import build_critic, explained_variance, token_values, value_loss
from rlkit.engines.kv_cache import generate
from rlkit.models import TinyQwen2
from rlkit.tasks.arithmetic import ALPHABET
from rlkit.types import Rollout


def test_critic_copies_the_backbone_and_starts_at_zero():
    policy, tok = TinyQwen2(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64).build(
        ALPHABET, 0
    )
    critic = build_critic(policy)
    for name, p in policy.base_model.state_dict().items():
        assert torch.equal(p, critic.base_model.state_dict()[name])
    pid, pmask, cid, cmask, tr = generate(policy, tok, ["1+2=", "3+4+5="], 5)[:5]
    values = token_values(critic, Rollout(pid, pmask, cid, cmask, tr, 1))
    assert values.shape == cid.shape and not values.any()
    critic.score.weight.data.fill_(0.1)
    assert token_values(critic, Rollout(pid, pmask, cid, cmask, tr, 1)).all()


def test_value_loss_clipped_by_hand():
    old, ret = torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])
    new = torch.tensor([0.5, 0.5])
    # row 0: unclipped (0.5-1)^2 = .25, clipped V=0.2 -> (0.2-1)^2 = .64 -> max .64 -> .32
    # row 1: unclipped (0.5+1)^2 = 2.25, clipped V=0.2 -> 1.44 -> max 2.25 -> 1.125
    assert value_loss(new, old, ret, clip=0.2).tolist() == pytest.approx([0.32, 1.125])


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(ret, ret, mask) == 1.0
    assert explained_variance(torch.zeros_like(ret) + 2, ret, mask) == pytest.approx(0.0)
