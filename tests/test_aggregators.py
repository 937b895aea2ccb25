"""Aggregators: hand-worked values, equivalences, and invariance to micro-batch splitting."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.aggregators import SeqMeanTokenMean, SeqMeanTokenSum, SeqMeanTokenSumNorm, TokenMean
from rlkit.refusals import ConfigError

L = torch.tensor([[1.0, 3.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize(
    "agg, expect",
    [
        (SeqMeanTokenMean(), (4 / 2 + 12 / 4) / 2),  # mean over sequences of token means
        (TokenMean(), (4 + 12) / 6),  # all tokens of the batch
        (SeqMeanTokenSum(), (4 + 12) / 2),  # mean over sequences of token sums
        (SeqMeanTokenSumNorm(constant=8), (4 / 8 + 12 / 8) / 2),
    ],
)
def test_aggregators_by_hand(agg, expect):
    assert float((L * agg.token_weights(MASK)).sum()) == pytest.approx(expect)


def test_sum_norm_is_sum_over_constant():
    a, b = SeqMeanTokenSumNorm(constant=5).token_weights(MASK), SeqMeanTokenSum().token_weights(MASK)
    assert torch.allclose(a, b / 5)


def test_length_bias_of_the_per_sequence_mean():
    w = SeqMeanTokenMean().token_weights(MASK)
    assert w[0, 0] == 2 * w[1, 0]  # the short answer's tokens weigh twice as much
    for agg in (TokenMean(), SeqMeanTokenSum(), SeqMeanTokenSumNorm(constant=4)):
        w = agg.token_weights(MASK)
        assert w[0, 0] == w[1, 0]


def test_bad_constant_is_refused():
    with pytest.raises(ConfigError, match="aggregator.constant must be > 0"):
        SeqMeanTokenSumNorm(constant=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.data())
def test_every_aggregator_gives_the_same_gradient_for_any_micro_batch_split(N, T, data):
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, T), min_size=N, max_size=N)))
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [N, T]
    size = data.draw(st.integers(1, N))
    for agg in (SeqMeanTokenMean(), TokenMean(), SeqMeanTokenSum(), SeqMeanTokenSumNorm(constant=T)):
        x = torch.randn(N, T, requires_grad=True)
        w = agg.token_weights(mask)  # whole-batch weights
        (x**2 * w).sum().backward()
        full = x.grad.clone()
        x.grad = None
        for idx in torch.arange(N).split(size):
            (x[idx] ** 2 * w[idx]).sum().backward()
        assert torch.allclose(x.grad, full, atol=1e-6)
