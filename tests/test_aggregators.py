"""Aggregators: hand-worked values and invariance to micro-batch splitting."""
import torch
from hypothesis import given, settings, strategies as st

from rlkit.aggregators import SeqMeanTokenMean


def test_seq_mean_token_mean_by_hand():
    L = torch.tensor([[1.0, 3.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    # ((1+3)/2 + (2+2+2+6)/4) / 2 = (2 + 3) / 2
    assert float((L * SeqMeanTokenMean().token_weights(mask)).sum()) == 2.5


def test_short_answers_tokens_weigh_more():
    w = SeqMeanTokenMean().token_weights(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert w[0, 0] == 2 * w[1, 0]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.data())
def test_micro_batch_split_gives_the_same_gradient(N, T, data):
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, T), min_size=N, max_size=N)))
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [N, T]
    x = torch.randn(N, T, requires_grad=True)
    w = SeqMeanTokenMean().token_weights(mask)  # whole-batch weights
    (x ** 2 * w).sum().backward()
    full = x.grad.clone()
    x.grad = None
    size = data.draw(st.integers(1, N))
    for idx in torch.arange(N).split(size):
        (x[idx] ** 2 * w[idx]).sum().backward()
    assert torch.allclose(x.grad, full, atol=1e-6)
