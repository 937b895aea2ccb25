"""The clipped surrogate's gradient on both sides of the clip band, and the KL estimators."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlkit.losses import PPOClip, clipped_surrogate, kl_estimate


def grad_at(ratio: float, adv: float, eps_low=0.2, eps_high=0.2, dual_clip=None) -> float:
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([[adv]]), eps_low, eps_high, dual_clip)
    loss.sum().backward()
    return float(logp.grad)


@pytest.mark.parametrize(
    "ratio, adv, expect",
    [
        (1.0, 1.0, -1.0),  # inside the band: d(-r*A)/dlogp = -r*A
        (1.1, 1.0, -1.1),
        (1.3, 1.0, 0.0),  # positive advantage above 1+eps_high: clipped, no gradient
        (0.7, 1.0, -0.7),  # positive advantage below the band keeps its gradient
        (0.7, -1.0, 0.0),  # negative advantage below 1-eps_low: clipped
        (1.3, -1.0, 1.3),  # negative advantage above the band keeps its gradient
        (0.9, -2.0, 1.8),
    ],
)
def test_clip_gradient_both_sides(ratio, adv, expect):
    assert grad_at(ratio, adv) == pytest.approx(expect, rel=1e-5, abs=1e-7)


def test_clip_higher_widens_the_upper_band_only():
    assert grad_at(1.25, 1.0, eps_high=0.28) == pytest.approx(-1.25, rel=1e-5)
    assert grad_at(1.25, 1.0, eps_high=0.2) == 0.0
    assert grad_at(0.75, -1.0, eps_high=0.28) == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    # ratio 5, A=-1: plain loss 5, dual clip c=3 caps it at 3 with zero gradient
    logp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    loss, _ = clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([[-1.0]]), 0.2, 0.2, dual_clip=3.0)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(3.0) and float(logp.grad) == 0.0


def test_clip_fractions_count_clipped_tokens():
    logp = torch.log(torch.tensor([[1.3, 0.7, 1.0, 0.7]]))
    _, info = clipped_surrogate(logp, torch.zeros(1, 4), torch.tensor([[1.0, -1.0, 1.0, 1.0]]), 0.2, 0.2)
    assert info["clip_frac_high"].tolist() == [[True, False, False, False]]
    assert info["clip_frac_low"].tolist() == [[False, True, False, False]]


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)  # ref/pi - log(ref/pi) - 1
    assert float(kl_estimate(ref, ref, "k3")) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.floats(-20, 0), st.floats(-20, 0))
@example(-2.36793921581079e-12, 0.0)  # exp(x) - x - 1 rounded to -1.1e-16 here
def test_k3_is_never_negative(logp, ref):
    assert float(kl_estimate(torch.tensor([logp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64))) >= 0


def test_policy_loss_adds_kl_only_in_loss_placement():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    adv = torch.zeros(1, 1)
    mask = torch.ones(1, 1)
    in_loss, _ = PPOClip(beta=0.1)(logp, logp, adv, mask, ref)
    in_reward, info = PPOClip(beta=0.1, kl_placement="reward")(logp, logp, adv, mask, ref)
    assert float(in_loss) == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert float(in_reward) == 0.0 and float(info["kl"]) > 0
