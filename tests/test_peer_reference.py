"""The advantage estimators and losses that peers ship, against the peers' own functions run on
shared random inputs (tests/fixtures/peer_reference.json, written by make_peer_reference.py from
verl's and SkyRL's sources at the commits it records; this test imports neither), to 1e-6; and
hand-worked numbers and properties from each paper's formula."""

import json
import math
from pathlib import Path

import pytest
import torch

from rlkit.advantages import GRPO, DrGRPO
from rlkit.corrections import SecondMomentMask
from rlkit.group_advantages import GPG, KRPO, OPO, OTB, MaxRL, PassK, ReinforcePP, ReinforcePPBaseline
from rlkit.losses import PPOClip
from rlkit.masked_losses import ASPO, BAPO, CEGPPO, DPPO, TOPR, Kimi, PolicyGradient
from rlkit.types import LossInput, Rollout

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "peer_reference.json").read_text())
CASES = REFERENCE["cases"]


def rollout(x: dict, kl: bool = False) -> Rollout:
    """The fixture's inputs as a rollout: the rewards, completion masks and (when the KL is in the
    reward) the per-token KL penalty."""
    mask = torch.tensor(x["mask"])  # [N, T]
    N, T = mask.shape
    z = torch.zeros(N, 1, dtype=torch.long)
    return Rollout(
        z, z + 1, torch.zeros(N, T, dtype=torch.long), mask.long(), torch.zeros(N, dtype=torch.bool), x["G"],
        rewards=torch.tensor(x["scores"]), shaping=torch.zeros(N),
        kl_penalty=torch.tensor(x["kl"]) if kl else None,
    )  # fmt: skip


ESTIMATORS = [
    ("reinforce_pp_baseline", ReinforcePPBaseline, {}),
    ("opo", OPO, {}),
    ("gpg", GPG, {}),
    ("maxrl", MaxRL, {}),
    ("passk_std", PassK, {"std": True}),
    ("passk", PassK, {"std": False}),
    ("krpo", KRPO, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
@pytest.mark.parametrize(("name", "cls", "kwargs"), ESTIMATORS, ids=[e[0] for e in ESTIMATORS])
def test_each_estimator_gives_the_peer_s_advantages(case, name, cls, kwargs):
    ours = cls(**kwargs)(rollout(case["inputs"]))  # [N, T]
    torch.testing.assert_close(ours, torch.tensor(case["outputs"][name]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
def test_reinforce_pp_gives_verl_s_whitened_token_returns_with_the_kl_in_the_reward(case):
    ours = ReinforcePP()(rollout(case["inputs"], kl=True))  # [N, T]
    torch.testing.assert_close(ours, torch.tensor(case["outputs"]["reinforce_pp"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
def test_the_optimal_token_baseline_gives_verl_s_advantages(case):
    x = case["inputs"]
    r = rollout(x, kl=True)
    r.policy_stats = torch.stack([torch.tensor(x["old_logp"]), torch.tensor(x["sum_pi_sq"])], -1)  # [N, T, 2]
    torch.testing.assert_close(OTB()(r), torch.tensor(case["outputs"]["otb"]), rtol=1e-6, atol=1e-6)
    tail = torch.tensor(case["outputs"]["otb_zero_tail"])
    torch.testing.assert_close(OTB(zero_tail=True)(r), tail, rtol=1e-6, atol=1e-6)


def test_the_optimal_token_baseline_by_hand():
    """Equal energies and lengths: the baseline at every position is the group's mean return (Dr.
    GRPO's advantage on every token). A group's single longest completion keeps its return as
    the advantage past the second-longest (`zero_tail`), or gets the lone baseline without it."""
    x = {"G": 2, "scores": [1.0, 0.0, 1.0, 0.0], "kl": [], "mask": [[1, 1, 1]] * 2 + [[1, 1, 1], [1, 0, 0]]}
    r = rollout(x)
    r.policy_stats = torch.stack([torch.full((4, 3), math.log(0.5)), torch.full((4, 3), 0.5)], -1)  # W_t = 0.5 t
    adv = OTB(zero_tail=True)(r)
    assert adv[:2].tolist() == [[0.5] * 3, [-0.5] * 3]  # returns 1, 0; baseline 0.5 at every position
    # group 2: position 0 has both (W = 0.5 each): baseline 0.5; positions 1, 2 only the long one, zeroed
    assert adv[2].tolist() == [0.5, 1.0, 1.0] and adv[3].tolist() == [-0.5, 0.0, 0.0]
    assert OTB(zero_tail=False)(r)[2].tolist() == pytest.approx([0.5, 0.0, 0.0], abs=1e-7)  # its own return as baseline


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
def test_the_plain_policy_gradient_and_dppo_give_the_peers_losses(case):
    x = {k: torch.tensor(case["inputs"][k]) for k in ("logp", "old_logp", "adv", "mask")}
    pg, _ = PolicyGradient().surrogate(x["logp"], x["old_logp"], x["adv"], x["mask"])  # [N, T]
    token_mean = (pg * x["mask"]).sum() / x["mask"].sum()  # verl's token-mean
    assert token_mean.item() == pytest.approx(case["outputs"]["gpg_loss"], rel=1e-6)
    for kind in ("binary_tv", "binary_kl"):
        loss, stats = DPPO(kind, 0.1, 0.1).surrogate(x["logp"], x["old_logp"], x["adv"], x["mask"])
        assert (loss * x["mask"]).sum().item() == pytest.approx(case["outputs"][f"dppo_{kind}"], rel=1e-6)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
def test_topr_and_the_kimi_loss_give_roll_s_per_token_losses(case):
    x = {k: torch.tensor(case["inputs"][k]) for k in ("logp", "old_logp", "adv", "mask", "scores")}
    topr, _ = TOPR().weighted_surrogate(LossInput(x["logp"], x["old_logp"], x["adv"], x["mask"], reward=x["scores"]))
    torch.testing.assert_close(topr, torch.tensor(case["outputs"]["topr"]), rtol=1e-6, atol=1e-6)
    kimi, _ = Kimi(tau=0.1).surrogate(x["logp"], x["old_logp"], x["adv"], x["mask"])
    torch.testing.assert_close(kimi, torch.tensor(case["outputs"]["kimi"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
def test_ce_gppo_gives_the_authors_loss_and_gradient(case):
    """The token-mean loss and its gradient with respect to the log-probs (the point of the loss: the
    clipped tokens' gradients), against the CE-GPPO authors' function at beta 0.75 / 1.0."""
    x = {k: torch.tensor(case["inputs"][k]) for k in ("logp", "old_logp", "adv", "mask")}
    logp = x["logp"].clone().requires_grad_()
    loss, _ = CEGPPO().surrogate(logp, x["old_logp"], x["adv"], x["mask"])
    mean = (loss * x["mask"]).sum() / x["mask"].sum()
    mean.backward()
    assert mean.item() == pytest.approx(case["outputs"]["ce_gppo_loss"], rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor(case["outputs"]["ce_gppo_grad"]), rtol=1e-6, atol=1e-7)


def test_ce_gppo_with_betas_of_zero_is_ppo_with_dual_clip():
    """beta 0 removes the clipped tokens' gradients: PPO's clip (with its dual clip of 3)."""
    g = torch.Generator().manual_seed(5)
    old, adv = -2 * torch.rand(6, 5, generator=g), torch.randn(6, 5, generator=g)
    grads = []
    for loss_fn in (CEGPPO(beta_low=0.0, beta_high=0.0), PPOClip(dual_clip=3.0)):
        logp = (old + 0.4 * torch.randn(6, 5, generator=g.manual_seed(6))).requires_grad_()
        loss_fn.surrogate(logp, old, adv, torch.ones(6, 5))[0].sum().backward()
        grads.append(logp.grad)
    torch.testing.assert_close(*grads)
    assert (grads[0] == 0).any()  # some token was clipped


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
def test_the_m2po_mask_is_areal_s(case):
    """AReaL's behaviour log-probs are the fixture's old_logp and its proximal ones the fixture's
    logp: in rlkit's terms mu and pi_old."""
    x = {k: torch.tensor(case["inputs"][k]) for k in ("logp", "old_logp", "adv", "mask")}
    weights, _ = SecondMomentMask(0.04)(None, x["logp"], x["old_logp"], x["adv"], x["mask"])
    reference = torch.tensor(case["outputs"]["m2po_mask"])
    assert torch.equal(weights * x["mask"], reference * x["mask"])
    assert 0 < (weights * x["mask"]).sum() < x["mask"].sum()  # some tokens masked, some kept


def test_m2po_masks_the_largest_until_the_mean_of_the_rest_is_under_the_threshold():
    """Squared log-ratios 0.09, 0.04, 0.01, 0 with a threshold of 0.03: the mean of all four is
    0.035, without the largest 0.0167: one token masked."""
    behaviour = torch.zeros(1, 4)
    old = torch.tensor([[0.3, -0.2, 0.1, 0.0]])
    weights, _ = SecondMomentMask(0.03)(None, old, behaviour, torch.ones(1, 4), torch.ones(1, 4))
    assert weights.tolist() == [[0.0, 1.0, 1.0, 1.0]]


def test_topr_tapers_only_negative_rows_and_the_positive_nll_acts_only_on_positive_rows():
    """Row 0 rewarded 1, row 1 rewarded 0, both with ratio e^0.5 > 1 and A = 1: TOPR's gradient on
    row 0 is -A (weight 1), on row 1 -min(r, 1) A = -1 too, and at ratio e^-0.5 it is -e^-0.5 on
    row 1 only. The positive NLL adds -mu log pi to row 0 alone."""
    old = torch.zeros(2, 1)
    for shift, negative_weight in ((0.5, 1.0), (-0.5, math.exp(-0.5))):
        logp = (old + shift).requires_grad_()
        x = LossInput(logp, old, torch.ones(2, 1), torch.ones(2, 1), reward=torch.tensor([1.0, 0.0]))
        TOPR().weighted_surrogate(x)[0].sum().backward()
        assert logp.grad[:, 0].tolist() == pytest.approx([-1.0, -negative_weight])
    logp = torch.full((2, 1), -0.3, requires_grad=True)
    x = LossInput(logp, logp.detach(), torch.zeros(2, 1), torch.ones(2, 1), reward=torch.tensor([1.0, 0.0]))
    loss, _ = PPOClip(positive_nll=0.1)(x)
    assert loss[:, 0].tolist() == pytest.approx([0.03, 0.0])


def hand(rewards: list[float], G: int, lengths=None) -> Rollout:
    T = max(lengths or [2])
    lengths = lengths or [2] * len(rewards)
    x = {"mask": [[1.0] * n + [0.0] * (T - n) for n in lengths], "scores": rewards, "G": G, "kl": None}
    return rollout(x)


def test_hand_worked_numbers_from_each_paper_s_formula():
    """Two groups of 4: [1, 0, 0, 0] and [1, 1, 0, 1]."""
    r = hand([1.0, 0, 0, 0, 1, 1, 0, 1], 4, lengths=[1, 2, 3, 2, 2, 2, 2, 2])
    # MaxRL: (r - p) / p, p = 1/4 and 3/4: 3, -1 and 1/3, -1
    assert MaxRL(eps=0)(r)[:, 0].tolist() == pytest.approx([3, -1, -1, -1, 1 / 3, 1 / 3, -1, 1 / 3])
    # OPO: b = (1*1) / (1+2+3+2) = 1/8 in the first group; 3/4 in the second (equal lengths)
    assert OPO()(r)[:, 0].tolist() == pytest.approx([7 / 8, -1 / 8, -1 / 8, -1 / 8, 1 / 4, 1 / 4, -3 / 4, 1 / 4])
    # GPG: alpha = 8 completions / 4 non-zero rewards = 2, times r - mean
    assert GPG()(r)[:, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, -1.5, 0.5])
    # pass@k: the first group's best gets 1 - 0 = 1 (std off), the second's best two tie: nothing
    assert PassK(std=False)(r)[:, 0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


def test_properties_that_relate_them_to_grpo():
    """With all lengths equal OPO is Dr. GRPO; with every reward non-zero GPG is Dr. GRPO; with one
    group of 4 completions of 3 tokens each, REINFORCE++-baseline is GRPO's z-score rescaled from
    the sample std of 4 rewards to the sample std of their 12 tokens: sqrt(11/9)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g).tolist()
    r = hand(rewards, 4, lengths=[3] * 12)
    torch.testing.assert_close(OPO()(r), DrGRPO()(r))
    torch.testing.assert_close(GPG()(r), DrGRPO()(r))
    one = hand(rewards[:4], 4, lengths=[3] * 4)
    grpo = GRPO(std="sample", eps=0)(one) * (11 / 9) ** 0.5
    torch.testing.assert_close(ReinforcePPBaseline()(one), grpo, rtol=1e-5, atol=1e-6)


def test_dppo_masks_only_tokens_pushed_past_delta_in_their_advantage_s_direction():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.7, 0.7, 0.3, 0.55]]))
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, stats = DPPO("binary_tv", 0.1, 0.1).surrogate(new, old, adv, torch.ones(1, 4))
    # up by 0.2 with A > 0: masked; up with A < 0: kept; down by 0.2 with A < 0: masked; up 0.05: kept
    assert stats["masked_frac"].tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert loss[0].tolist() == pytest.approx([0.0, 1.4, 0.0, -1.1])


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
@pytest.mark.parametrize("which", ["aspo", "aspo_wide"])
def test_aspo_gives_the_authors_per_token_loss_and_gradient(case, which):
    """Against the ASPO authors' function (Archer2.0) with the settings their actor passes, on the
    fixture's log-ratios and on four times them (`aspo_wide`: ratios past both soft dual clips): the
    per-token loss and its gradient with respect to the log-probs, on the completion tokens; the
    forking tokens from each row's entropies as their actor selects them."""
    x = {k: torch.tensor(case["inputs"][k]) for k in ("logp", "old_logp", "adv", "mask", "entropy")}
    if which == "aspo_wide":
        x["logp"] = x["old_logp"] + 4 * (x["logp"] - x["old_logp"])
    logp = x["logp"].clone().requires_grad_()
    loss, stats = ASPO().weighted_surrogate(LossInput(logp, x["old_logp"], x["adv"], x["mask"], entropy=x["entropy"]))
    (loss * x["mask"]).sum().backward()
    m = x["mask"].bool()
    torch.testing.assert_close(loss[m], torch.tensor(case["outputs"][f"{which}_loss"])[m], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp.grad[m], torch.tensor(case["outputs"][f"{which}_grad"])[m], rtol=1e-6, atol=1e-6)
    if which == "aspo_wide":
        assert stats["dual_clip_frac"][m].sum() > 0 and stats["clip_frac_high"][m].sum() > 0


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c['seed']}" for c in CASES])
@pytest.mark.parametrize("shift", ["0", "0.2", "0.8"])
def test_bapo_searches_the_authors_bounds_and_gives_their_loss_and_gradient(case, shift):
    """Against the BAPO authors' recipe function at the paper's target and ranges, on the fixture's
    advantages minus 0, 0.2 and 0.8 (more and more negative: no search, a search that stops part of the
    way (seed 1: high 1.45), one that runs to both limits): the bounds chosen, the per-token loss and its
    gradient with respect to the log-probs, on the completion tokens."""
    x = {k: torch.tensor(case["inputs"][k]) for k in ("logp", "old_logp", "adv", "mask")}
    adv = x["adv"] - float(shift) * x["mask"]
    logp = x["logp"].clone().requires_grad_()
    loss, stats = BAPO().surrogate(logp, x["old_logp"], adv, x["mask"])
    (loss * x["mask"]).sum().backward()
    out, m = case["outputs"], x["mask"].bool()
    bounds = torch.tensor([stats["clip_low"][0, 0], stats["clip_high"][0, 0]])
    torch.testing.assert_close(bounds, torch.tensor(out[f"bapo_shift{shift}_bounds"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(loss[m], torch.tensor(out[f"bapo_shift{shift}_loss"])[m], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp.grad[m], torch.tensor(out[f"bapo_shift{shift}_grad"])[m], rtol=1e-6, atol=1e-6)
