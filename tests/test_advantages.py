"""GRPO advantages against hand-worked numbers, and their properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_rollout as rollout
from rlkit.advantages import GRPO


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
    with pytest.raises(ValueError, match="group_size >= 2"):
        GRPO()(rollout([1.0, 0.0], 1))


def test_unknown_std_is_an_error():
    with pytest.raises(ValueError, match="'sample' or 'population'"):
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
