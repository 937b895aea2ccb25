"""The policy losses against hand-worked numbers: the clipped surrogate's gradient on both sides of
the clip band, GSPO, CISPO and SAPO ratios, clipping and gradients (at ratio 1 every loss gives
PPO's gradient), the options every loss shares, and the KL estimators."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import make_rollout
from rlkit.aggregators import SeqMeanTokenMean
from rlkit.losses import CISPO, GSPO, SAPO, PPOClip, clipped_surrogate, kl_estimate
from rlkit.metrics import update_metrics
from rlkit.refusals import ConfigError
from rlkit.types import LossInput, UpdateStats


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
    # with the last token masked out: 1 of the 3 tokens clipped above, 1 of the 2 the upper bound can act
    # on (A > 0); the lower bound clipped its one negative-advantage token
    stats = UpdateStats()
    stats.add(info, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    out = update_metrics(stats)
    assert out["train/clip_frac_high"] == pytest.approx(1 / 3)
    assert out["train/clip_frac_high_of_pos"] == pytest.approx(1 / 2)
    assert out["train/clip_frac_low_of_neg"] == 1.0
    only_positive = UpdateStats()
    only_positive.add(info, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    assert update_metrics(only_positive)["train/clip_frac_low_of_neg"] is None  # no token it can act on


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
    in_loss, _ = PPOClip(beta=0.1)(LossInput(logp, logp, adv, mask, ref))
    in_reward, info = PPOClip(beta=0.1, kl_placement="reward")(LossInput(logp, logp, adv, mask, ref))
    assert float(in_loss) == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert float(in_reward) == 0.0 and float(info["kl"]) > 0


def close(t, expected):
    return torch.allclose(t.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-9)


def grads(loss_fn, log_ratio, adv, mask, weights=None):
    """Loss and d(sum(L * weights))/d logp at logp = old_logp + log_ratio (old_logp = 0)."""
    logp = torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor(adv, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64)
    L, stats = loss_fn(LossInput(logp, torch.zeros_like(logp), adv, mask))
    (L * (mask if weights is None else weights)).sum().backward()
    return L.detach(), logp.grad, stats


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio():
    # seq 0: token log-ratios 0.2, 0.0 -> s = e^0.1 = 1.1052 > 1 + 0.05 with A = +1: clipped, loss -1.05, no gradient
    # seq 1: log-ratios 0, -0.3, 0 -> s = e^-0.1 = 0.9048 < 1 - 0.05 with A = +1: below the band keeps its gradient;
    #        loss -s on each token; with per-sequence token-mean weights 1/(N |o|) each token's gradient is -s/(3*2)
    mask = [[1, 1, 0], [1, 1, 1]]
    weights = SeqMeanTokenMean().token_weights(torch.tensor(mask)).double()
    L, g, stats = grads(
        GSPO(eps_low=0.05, eps_high=0.05),
        [[0.2, 0.0, 9.0], [0.0, -0.3, 0.0]],
        [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
        mask,
        weights,
    )
    s1 = math.exp(-0.1)
    assert close(L, [[-1.05, -1.05, 0.0], [-s1, -s1, -s1]])
    assert close(g, [[0.0, 0.0, 0.0], [-s1 / 6] * 3])
    assert stats["clip_frac_high"].tolist() == [[1, 1, 0], [0, 0, 0]]
    clipped, positive = stats["clip_frac_high_of_pos"]  # each sequence's value on its tokens
    assert clipped.tolist() == [[1, 1, 0], [0, 0, 0]] and positive.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert close(stats["ratio_dev"][1], [1 - s1] * 3)


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_stopped_weight():
    # ratios 1.5, 0.5, 1.0 with A = 1, -1, 2; weight clip(r, 0, 1.28) = 1.28, 0.5, 1.0; d/dlogp = -weight * A
    L, g, stats = grads(
        CISPO(eps_low=1.0, eps_high=0.28), [[math.log(1.5), math.log(0.5), 0.0]], [[1.0, -1.0, 2.0]], [[1, 1, 1]]
    )
    assert close(g, [[-1.28, 0.5, -2.0]])
    assert close(L, [[-1.28 * math.log(1.5), 0.5 * math.log(0.5), 0.0]])
    assert stats["clip_frac_high"].tolist() == [[True, False, False]]
    # PPO drops both outer tokens' gradients (positive A above the band, negative A below it)
    assert close(
        grads(PPOClip(), [[math.log(1.5), math.log(0.5), 0.0]], [[1.0, -1.0, 2.0]], [[1, 1, 1]])[1], [[0.0, 0.0, -2.0]]
    )


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_by_hand():
    # token 0: r = 1.5, A = 1, tau 1: loss -4 sig(0.5); gradient -4 sig'(0.5) r A (PPO would give 0)
    # token 1: r = 0.5, A = -1, tau 1.05: loss (4/1.05) sig(-0.525); gradient -4 sig'(-0.525) r A
    L, g, stats = grads(SAPO(tau_pos=1.0, tau_neg=1.05), [[math.log(1.5), math.log(0.5)]], [[1.0, -1.0]], [[1, 1]])
    d = lambda x: sigmoid(x) * (1 - sigmoid(x))  # noqa: E731
    assert close(L, [[-4 * sigmoid(0.5), 4 / 1.05 * sigmoid(-0.525)]])
    assert close(g, [[-4 * d(0.5) * 1.5, 4 * d(-0.525) * 0.5]])
    assert close(stats["gate"], [[4 * d(0.5), 4 * d(-0.525)]])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=2, max_size=4), st.integers(1, 4))
def test_at_ratio_one_every_loss_has_ppos_gradient(seq_adv, T):
    """With one update per rollout the ratio is 1; there GSPO, CISPO and SAPO all give PPO's gradient
    (GSPO with a sequence-constant advantage and per-sequence token-mean weights)."""
    N = len(seq_adv)
    adv = [[a] * T for a in seq_adv]
    mask = [[1] * T for _ in range(N)]
    weights = SeqMeanTokenMean().token_weights(torch.tensor(mask)).double()
    zero = [[0.0] * T for _ in range(N)]
    ppo = grads(PPOClip(), zero, adv, mask, weights)[1]
    for loss in (GSPO(), CISPO(), SAPO()):
        assert torch.allclose(grads(loss, zero, adv, mask, weights)[1], ppo, atol=1e-12), type(loss).__name__


def test_drop_truncated_removes_truncated_rows_from_the_training_mask():
    r = make_rollout([1.0, 0.0], G=2, lengths=[2, 4])
    r.truncated = torch.tensor([False, True])
    assert PPOClip(drop_truncated=True).train_mask(r).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert PPOClip().train_mask(r).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_kl_in_the_reward_is_beta_times_the_estimate_and_stays_out_of_the_loss():
    loss = SAPO(beta=0.5, kl_estimator="k1", kl_placement="reward")
    old, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]])
    assert loss.kl_in_reward and loss.kl_penalty(old, ref).tolist() == [[0.5, 0.0]]
    L, stats = loss(LossInput(old, old, torch.zeros(1, 2), torch.ones(1, 2), ref))
    assert L.tolist() == [[0.0, 0.0]] and stats["kl"].tolist() == [[1.0, 0.0]]
    assert not SAPO(beta=0.0, kl_placement="reward").kl_in_reward  # beta 0: no reference at all


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: PPOClip(eps_low=1.0), "loss.eps_low must be in"),
        (lambda: GSPO(eps_high=-1), "loss.eps_high must be >= 0"),
        (lambda: SAPO(tau_neg=0), "loss.tau_pos and loss.tau_neg must be > 0"),
        (lambda: CISPO(kl_estimator="k9"), "loss.kl_estimator must be one of k1, k2, k3"),
        (lambda: PPOClip(kl_placement="both"), "loss.kl_placement must be 'loss' or 'reward'"),
    ],
)
def test_bad_loss_options_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_dro_is_the_quadratic_penalised_policy_gradient_by_hand(fast_cfg):
    """`loss=dro`: -(A log pi - beta/2 (log pi - log pi_old)^2) per token with beta 0.05. By hand:
    log pi -1.0, log pi_old -1.2, A 2: -(-2 - 0.025 * 0.04) = 2.001; its gradient in log pi is
    -A + beta (log pi - log pi_old) = -2 + 0.01 = -1.99; at log pi = log pi_old, plain -A."""
    from rlkit.config import build

    dro = build(fast_cfg("loss=dro"), "loss")
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    loss, _ = dro.surrogate(logp, torch.tensor([[-1.2, -0.5]]), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    torch.testing.assert_close(loss.detach(), torch.tensor([[2.001, -0.5]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.99, 1.0]]))
