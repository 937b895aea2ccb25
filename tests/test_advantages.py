"""Advantage estimators: GRPO, Dr. GRPO, RLOO, GAE and process supervision against hand-worked
numbers, equivalences and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_rollout as rollout
from rlkit.advantages import GAE, GRPO, RLOO, DrGRPO, ProcessSupervision
from rlkit.guards import checked_advantages
from rlkit.refusals import ConfigError


def seq(adv):  # first token's advantage of each row
    return adv[:, 0]


def test_grpo_sample_std_by_hand():
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025
    adv = GRPO(std="sample", eps=0.0)(rollout([1, 0, 0, 1], 4))
    assert torch.allclose(seq(adv), torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-6)


def test_grpo_population_std_by_hand():
    # population std 0.5 -> +-1
    adv = GRPO(std="population", eps=0.0)(rollout([1, 0, 0, 1], 4))
    assert torch.allclose(seq(adv), torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_grpo_mixed_groups_by_hand():
    # group 1: [1,0,0,0] mean .25, sample std sqrt(.75/3) = .5 -> [1.5, -.5, -.5, -.5]
    # group 2: [2,4,6,8] mean 5, sample std sqrt(20/3) = 2.581989 -> [-1.161895, -.387298, .387298, 1.161895]
    adv = GRPO(eps=0.0)(rollout([1, 0, 0, 0, 2, 4, 6, 8], 4))
    expect = [1.5, -0.5, -0.5, -0.5, -1.161895, -0.387298, 0.387298, 1.161895]
    assert torch.allclose(seq(adv), torch.tensor(expect), atol=1e-5)


def test_all_equal_group_is_exactly_zero():
    adv = GRPO()(rollout([0.1, 0.1, 0.1, 0.7, 0.3, 0.3], 3))
    assert torch.equal(adv[:3], torch.zeros(3, 4))
    assert not torch.isnan(adv).any()


def test_advantage_is_copied_to_completion_tokens_only():
    adv = GRPO(eps=0.0, std="population")(rollout([1, 0], 2, lengths=[2, 3]))
    assert adv.tolist() == [[1, 1, 0, 0], [-1, -1, -1, 0]]


def test_group_of_one_is_an_error():
    with pytest.raises(ConfigError, match="group_size >= 2"):
        GRPO()(rollout([1.0, 0.0], 1))


def test_unknown_std_is_an_error():
    with pytest.raises(ConfigError, match="'sample' or 'population'"):
        GRPO(std="median")


def test_population_and_sample_std_differ_by_bessel_factor():
    r = rollout([3.0, 1.0, 4.0, 1.0, 5.0], 5)
    sample, pop = GRPO(eps=0.0)(r), GRPO(std="population", eps=0.0)(r)
    assert torch.allclose(pop, sample * math.sqrt(5 / 4), atol=1e-6)


groups = st.integers(2, 6).flatmap(
    lambda G: st.tuples(
        st.just(G),
        st.lists(
            st.lists(st.floats(-10, 10, width=32, allow_subnormal=False), min_size=G, max_size=G),
            min_size=1,
            max_size=4,
        ),
    )
)  # subnormal rewards: float32 cannot centre them


@settings(max_examples=60, deadline=None)
@given(groups, st.floats(-5, 5), st.floats(0.1, 10))
def test_grpo_properties(g, shift, scale):
    G, rows = g
    flat = [x for row in rows for x in row]
    est = GRPO(eps=0.0)
    base = seq(est(rollout(flat, G))).view(-1, G)  # [P, G]
    assert torch.allclose(base.sum(1), torch.zeros(len(rows)), atol=1e-4)  # sums to zero per group
    shifted = seq(est(rollout([x + shift for x in flat], G))).view(-1, G)
    scaled = seq(est(rollout([x * scale for x in flat], G))).view(-1, G)
    spread = torch.tensor(rows).std(1, keepdim=True) > 1e-3  # skip near-degenerate groups (float rounding)
    assert torch.allclose(shifted * spread, base * spread, atol=1e-3)
    assert torch.allclose(scaled * spread, base * spread, atol=1e-3)


def test_batch_std_scope_divides_by_the_std_of_the_whole_batch():
    # rewards [[1, 0], [1, 1]]: group means .5 and 1; batch sample std of (1, 0, 1, 1) is 0.5
    r = rollout([1.0, 0.0, 1.0, 1.0], G=2)
    assert GRPO(eps=0.0, std_scope="batch")(r)[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0]
    group = GRPO(eps=0.0)(r)[:, 0]
    assert group[:2].tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)]) and group[2:].tolist() == [0.0, 0.0]


def test_dr_grpo_by_hand():
    adv = DrGRPO()(rollout([1, 0, 0, 0], 4))
    assert adv[:, 0].tolist() == [0.75, -0.25, -0.25, -0.25]


def test_rloo_by_hand():
    # r_0 = 1, baseline = mean of others = 0 -> 1; r_1 = 0, baseline (1+0+0)/3 -> -1/3
    adv = RLOO()(rollout([1, 0, 0, 0], 4))
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_reward_shaping_and_kl_penalty_enter_the_group_return():
    r = rollout([1, 1], 2, lengths=[2, 4], shaping=[0.0, -0.5])
    r.kl_penalty = torch.full((2, 4), 0.25)  # summed over each completion's tokens: 0.5 and 1.0
    # returns 0.5 and -0.5 -> Dr. GRPO advantages +-0.5
    assert DrGRPO()(r)[:, 0].tolist() == [0.5, -0.5]


group_rewards = st.integers(2, 6).flatmap(
    lambda G: st.tuples(
        st.just(G),
        st.lists(st.floats(-5, 5, width=32, allow_subnormal=False), min_size=G, max_size=3 * G).map(
            lambda x: x[: len(x) // G * G]
        ),
    )
)  # float32 rewards without subnormals, which float32 cannot centre


@settings(max_examples=60, deadline=None)
@given(group_rewards, st.floats(-3, 3))
def test_group_estimators_properties(g, shift):
    G, flat = g
    for est in (GRPO(eps=0.0), DrGRPO(), RLOO()):
        base = est(rollout(flat, G))[:, 0].view(-1, G)
        assert torch.allclose(base.sum(1), torch.zeros(base.shape[0]), atol=1e-3)  # zero-sum per group
        shifted = est(rollout([x + shift for x in flat], G))[:, 0].view(-1, G)
        spread = torch.tensor(flat).view(-1, G).std(1, keepdim=True) > 1e-2
        assert torch.allclose(shifted * spread, base * spread, atol=1e-3)  # shift-invariant
    # Dr. GRPO equals RLOO times (G-1)/G
    assert torch.allclose(DrGRPO()(rollout(flat, G)), RLOO()(rollout(flat, G)) * (G - 1) / G, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(group_rewards, st.integers(1, 5))
def test_padding_changes_nothing(g, extra):
    G, flat = g
    lengths = [1 + i % 3 for i in range(len(flat))]
    for est in (GRPO(), DrGRPO(), RLOO(), GAE(lam=0.9, whiten=True)):
        values = torch.linspace(0, 1, 3 + extra)[None].expand(len(flat), -1)
        a = checked_advantages(est, rollout(flat, G, lengths, T=3), values[:, :3])[0]
        b = checked_advantages(est, rollout(flat, G, lengths, T=3 + extra), values)[0]
        assert torch.allclose(b[:, :3], a, atol=1e-5) and not b[:, 3:].any()


def test_gae_with_unit_gamma_lambda_and_zero_values_is_reward_to_go():
    r = rollout([1.0, -2.0], 1, lengths=[3, 2], T=4)
    r.kl_penalty = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 0.5, 0.0, 0.0]])
    adv, ret = GAE(gamma=1.0, lam=1.0, whiten=False)(r, torch.zeros(2, 4))
    # token rewards: [-0.1, -0.2, 1-0.3] and [-0.5, -2-0.5]; reward-to-go sums from t to the end
    expect = torch.tensor([[0.4, 0.5, 0.7, 0.0], [-3.0, -2.5, 0.0, 0.0]])
    assert torch.allclose(adv, expect) and torch.allclose(ret, expect)


def test_gae_by_hand():
    # one completion of 3 tokens, reward 1 at the end, V = [0.5, 0.2, 0.6], gamma 0.9, lambda 0.5
    r = rollout([1.0], 1, lengths=[3], T=3)
    v = torch.tensor([[0.5, 0.2, 0.6]])
    adv, ret = GAE(gamma=0.9, lam=0.5, whiten=False)(r, v)
    d = [0 + 0.9 * 0.2 - 0.5, 0 + 0.9 * 0.6 - 0.2, 1 - 0.6]  # deltas
    a2 = d[2]
    a1 = d[1] + 0.45 * a2
    a0 = d[0] + 0.45 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]])) and torch.allclose(ret, adv + v)


def test_gae_whitening_over_the_batch():
    r = rollout([1.0, 0.0, 3.0], 1, lengths=[2, 3, 1], T=3)
    adv, _ = GAE(lam=1.0)(r, torch.zeros(3, 3))
    m = r.completion_mask.bool()
    assert abs(float(adv[m].mean())) < 1e-6 and float(adv[m].std()) == pytest.approx(1.0, abs=1e-5)
    assert not adv[~m].any()


def test_process_supervision_by_hand():
    # group of 2; completion 0 has steps ending at tokens 1 and 3 with rewards 1, 0;
    # completion 1 one step at token 2 with reward 1. Step rewards [1, 0, 1]: mean 2/3, sample std 0.57735
    r = rollout([0.0, 1.0], 2, lengths=[4, 3], T=4)
    r.step_rewards = torch.tensor([[0, 1.0, 0, 0.0], [0, 0, 1.0, 0]])
    r.step_mask = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]]).bool()
    adv = ProcessSupervision(eps=0.0)(r)
    hi, lo = (1 - 2 / 3) / 0.57735027, (0 - 2 / 3) / 0.57735027
    expect = torch.tensor([[hi + lo, hi + lo, lo, lo], [hi, hi, hi, 0.0]])
    assert torch.allclose(adv, expect, atol=1e-5)


def test_process_supervision_equal_steps_give_zero():
    r = rollout([1.0, 1.0], 2, lengths=[2, 2], T=2)
    r.step_rewards, r.step_mask = torch.ones(2, 2), torch.ones(2, 2).bool()
    assert not ProcessSupervision()(r).any()
