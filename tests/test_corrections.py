"""Off-policy corrections: hand-worked weights for each, weight 1 (the same gradient) when the
engine's numbers are the trainer's, and TRL's loss reproduced with the weights applied."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.corrections import NoCorrection, OffPolicySequenceMask, SequenceIS, TokenMIS, TokenTIS
from rlkit.losses import CISPO, GMPO, GSPO, SAPO, VESPO, KLCov, PPOClip
from rlkit.refusals import ConfigError
from rlkit.types import LossInput

# pi_old / mu per token: row 0 = [3, 0.6, 1], row 1 = [0.2, 1.5, (padding)]
RHO = torch.tensor([[3.0, 0.6, 1.0], [0.2, 1.5, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
OLD = torch.zeros(2, 3, dtype=torch.float64)
BEHAVIOUR = OLD - RHO.log()
ADV = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)


def weights(correction, logp=OLD, adv=ADV):
    w, stats = correction(logp, OLD, BEHAVIOUR, adv, MASK)
    return (w * MASK).tolist(), stats


def close(a, b):
    return all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_token_truncated_is_clips_each_ratio_from_above():
    w, stats = weights(TokenTIS(c_max=2.0))
    assert close(w, [[2.0, 0.6, 1.0], [0.2, 1.5, 0.0]])
    assert (stats["is_clipped"] * MASK).tolist() == [[1, 0, 0], [0, 0, 0]]


def test_token_masked_is_zeroes_ratios_outside_the_band():
    w, stats = weights(TokenMIS(c_min=0.5, c_max=5.0))  # 0.2 < 0.5: masked; 3 stays
    assert close(w, [[3.0, 0.6, 1.0], [0.0, 1.5, 0.0]])
    assert (stats["is_masked"] * MASK).tolist() == [[0, 0, 0], [1, 0, 0]]


def test_sequence_is_uses_the_geometric_mean_or_the_product():
    g0, g1 = (3 * 0.6 * 1) ** (1 / 3), (0.2 * 1.5) ** 0.5  # 1.2164, 0.5477: both inside [0.5, 2]
    w, _ = weights(SequenceIS("truncate", "geometric"))
    assert close(w, [[g0] * 3, [g1, g1, 0.0]])
    w, _ = weights(SequenceIS("mask", "geometric"))
    assert close(w, [[g0] * 3, [g1, g1, 0.0]])
    w, _ = weights(SequenceIS("truncate", "product"))  # 1.8 and 0.3 -> clipped to 0.5
    assert close(w, [[1.8] * 3, [0.5, 0.5, 0.0]])
    w, stats = weights(SequenceIS("mask", "product"))  # 0.3 < 0.5: the whole sequence masked
    assert close(w, [[1.8] * 3, [0.0, 0.0, 0.0]])
    assert (stats["is_seq_outside"] * MASK).tolist() == [[0, 0, 0], [1, 1, 0]]


def test_the_off_policy_sequence_mask_drops_only_negative_far_sequences():
    # mean log(mu / pi_theta) at pi_theta = pi_old:
    # row 0 -(ln 3 + ln 0.6)/3 = -0.196; row 1 -(ln 0.2 + ln 1.5)/2 = 0.602
    w, _ = weights(OffPolicySequenceMask(delta=0.5))  # row 1 has A < 0 and 0.602 > 0.5: dropped
    assert close(w, [[1.0] * 3, [0.0, 0.0, 0.0]])
    w, _ = weights(OffPolicySequenceMask(delta=0.5), adv=-ADV)  # row 0 negative but close: kept; row 1 positive: kept
    assert close(w, [[1.0] * 3, [1.0, 1.0, 0.0]])
    w, _ = weights(OffPolicySequenceMask(delta=0.7))
    assert close(w, [[1.0] * 3, [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "bad",
    [
        lambda: TokenTIS(c_max=0.5),
        lambda: TokenMIS(c_min=1.5),
        lambda: SequenceIS(mode="clip"),
        lambda: SequenceIS(level="arithmetic"),
        lambda: OffPolicySequenceMask(delta=-1),
    ],
)
def test_impossible_bounds_are_refused(bad):
    with pytest.raises(ConfigError, match="correction\\."):
        bad()


CORRECTIONS = [
    NoCorrection(),
    TokenTIS(),
    TokenMIS(),
    SequenceIS("truncate"),
    SequenceIS("mask"),
    SequenceIS("mask", "product"),
    OffPolicySequenceMask(),
]
LOSSES = [PPOClip(), GSPO(), CISPO(), SAPO(), GMPO(), VESPO(), KLCov(), PPOClip(beta=0.1, kl_is_weighted=True)]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), first_update=st.booleans())
def test_with_the_trainers_own_numbers_every_correction_leaves_the_gradient_unchanged(seed, first_update):
    """mu = pi_old (k = 0, no mismatch): every weight is 1, so every loss's gradient is unchanged.
    The sequence mask compares with pi_theta, so it is only neutral at a rollout's first update."""
    g = torch.Generator().manual_seed(seed)
    n, T = 4, 5
    old = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    logp0 = old if first_update else old + 0.3 * torch.randn(n, T, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(n, T, generator=g, dtype=torch.float64)
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, T)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (n, 1), generator=g)).double()
    for loss in LOSSES:
        for correction in CORRECTIONS if first_update else CORRECTIONS[:-1]:
            grads = []
            for use in (False, True):
                logp = logp0.clone().requires_grad_(True)
                w = correction(logp.detach(), old, old, adv, mask)[0] if use else None
                L, _ = loss(LossInput(logp, old, adv, mask, ref if loss.beta else None, is_weight=w))
                (L * mask).sum().backward()
                grads.append(logp.grad)
            assert torch.equal(grads[0], grads[1]), (type(loss).__name__, type(correction).__name__)
