"""The loss options the peers ship: GMPO, VESPO, Clip-Cov, KL-Cov, LUSPO (GSPO with token-sum
aggregation), the importance-weighted KL, top-entropy token selection and the adaptive entropy
coefficient, against hand-worked numbers; and against TRL 1.16's own `GRPOTrainer._compute_loss`
on shared random inputs wherever TRL has the same option."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from rlkit.aggregators import SeqMeanTokenMean, SeqMeanTokenSum, TokenMean
from rlkit.corrections import OffPolicySequenceMask, SequenceIS, TokenMIS, TokenTIS
from rlkit.losses import GMPO, GSPO, VESPO, ClipCov, KLCov, PPOClip
from rlkit.types import LossInput

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def grad_of(loss_fn, logp0, old, adv, mask, weights, **kw):
    """(per-token loss, d sum(L * weights) / d logp)."""
    logp = logp0.clone().requires_grad_(True)
    L, stats = loss_fn(LossInput(logp, old, adv, mask, **kw))
    (L * weights).sum().backward()
    return L.detach(), logp.grad, stats


def test_gmpo_takes_the_geometric_mean_of_token_clipped_ratios():
    # log-ratios [0.6, -0.1], eps 0.4: A > 0 keeps min(l, clip(l)) = [0.4, -0.1] -> ratio e^0.15 on both tokens;
    # the clipped token has no gradient, the other gets -e^0.15 / 2 (one sequence, token mean)
    mask, old = t([[1, 1]]), t([[0.0, 0.0]])
    w = SeqMeanTokenMean().token_weights(mask)
    L, g, stats = grad_of(GMPO(), t([[0.6, -0.1]]), old, t([[1.0, 1.0]]), mask, w)
    assert torch.allclose(L, t([[-math.exp(0.15)] * 2])) and torch.allclose(g, t([[0.0, -math.exp(0.15) / 2]]))
    assert stats["clip_frac_high"].tolist() == [[True, False]]
    # A < 0 keeps max(l, clip(l)) = [0.6, -0.1] -> loss +e^0.25, both tokens carry gradient e^0.25 / 2
    L, g, _ = grad_of(GMPO(), t([[0.6, -0.1]]), old, t([[-1.0, -1.0]]), mask, w)
    assert torch.allclose(L, t([[math.exp(0.25)] * 2])) and torch.allclose(g, t([[math.exp(0.25) / 2] * 2]))


def test_vespo_scales_the_policy_gradient_by_the_gamma_weight_of_the_sequence_ratio():
    # log w = 0.1 + 0.2 = 0.3; A >= 0: phi = exp(3 + 2*0.3 - 3 e^0.3) = 0.63787; L = -phi A logp, gradient -phi
    phi = math.exp(3 + 0.6 - 3 * math.exp(0.3))
    mask, logp = t([[1, 1]]), t([[0.1, 0.2]])
    L, g, stats = grad_of(VESPO(), logp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), mask, mask)
    assert torch.allclose(L, -phi * logp) and torch.allclose(g, t([[-phi, -phi]]))
    assert math.isclose(float(stats["phi"][0, 0]), phi, rel_tol=1e-9)
    # a correction weight enters w in log space: is_weight [e^-0.3, 1] gives log w = 0 -> phi(1) = 1
    L, g, _ = grad_of(VESPO(), logp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), mask, mask, is_weight=t([[math.exp(-0.3), 1]]))
    assert torch.allclose(g, t([[-1.0, -1.0]]))


def test_clip_cov_detaches_unclipped_tokens_in_the_covariance_band():
    # 2 rows x 1 token, A = [2, -2], log pi = [0, -2]: centred products (2)(1) = 2 and (-2)(-1) = 2, in (1, 5)
    mask, logp, adv = t([[1], [1]]), t([[0.0], [-2.0]]), t([[2.0], [-2.0]])
    w = TokenMean().token_weights(mask)
    _, g, stats = grad_of(ClipCov(clip_cov_ratio=1.0), logp, logp, adv, mask, w)  # every candidate chosen
    assert g.tolist() == [[0.0], [0.0]] and stats["cov_detached"].tolist() == [[1.0], [1.0]]
    _, g, _ = grad_of(ClipCov(clip_cov_ratio=1.0, clip_cov_lb=2.5), logp, logp, adv, mask, w)  # none in band: PPO
    _, g_ppo, _ = grad_of(PPOClip(), logp, logp, adv, mask, w)
    assert torch.equal(g, g_ppo) and g.tolist() == [[-1.0], [1.0]]
    torch.manual_seed(0)  # ratio 0.5 of 2 tokens: exactly one of the two is detached
    _, g, _ = grad_of(ClipCov(clip_cov_ratio=0.5), logp, logp, adv, mask, w)
    assert sorted(abs(x) for x in g.flatten().tolist()) == [0.0, 1.0]


def test_kl_cov_penalises_the_token_of_largest_covariance():
    # A = [1, -1, 0.5], log pi = [-1, -1.9, -0.5] (old + [0, 0.1, 0]): centred products 0.111, 0.894, 0.211;
    # the top 1 (ratio 1/3) is token 1: loss -A r + |log r| there, gradient e^0.1 + 1
    mask, adv = t([[1, 1, 1]]), t([[1.0, -1.0, 0.5]])
    old, logp = t([[-1.0, -2.0, -0.5]]), t([[-1.0, -1.9, -0.5]])
    L, g, stats = grad_of(KLCov(kl_cov_ratio=0.34), logp, old, adv, mask, mask)
    assert stats["kl_cov_penalised"].tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(L, t([[-1.0, math.exp(0.1) + 0.1, -0.5]]))
    assert torch.allclose(g, t([[-1.0, math.exp(0.1) + 1, -0.5]]))


def test_the_importance_weighted_kl_multiplies_the_kl_by_the_ratio():
    # log pi = -1, old = -1.2 (r = e^0.2), ref = -1.5: k3 = e^-0.5 + 0.5 - 1 = 0.10653; weighted: 0.10653 e^0.2
    x = LossInput(t([[-1.0]]), t([[-1.2]]), t([[0.0]]), t([[1.0]]), ref_logp=t([[-1.5]]))
    plain, _ = PPOClip(beta=1.0)(x)
    weighted, _ = PPOClip(beta=1.0, kl_is_weighted=True)(x)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert math.isclose(float(plain), k3, rel_tol=1e-9) and math.isclose(
        float(weighted), k3 * math.exp(0.2), rel_tol=1e-9
    )


def test_top_entropy_selection_keeps_tokens_at_or_above_the_quantile():
    # 5 valid entropies 0.1 0.3 0.5 0.7 0.9; rho 0.4 -> the 0.6 quantile 0.58 -> tokens 0.9 and 0.7
    entropy, mask = t([[0.1, 0.9, 0.5], [0.7, 0.3, 5.0]]), t([[1, 1, 1], [1, 1, 0]])
    assert PPOClip(top_entropy_quantile=0.4).token_selection(entropy, mask).tolist() == [[0, 1, 0], [1, 0, 0]]
    assert PPOClip().token_selection(entropy, mask) is None and not PPOClip().selects_tokens


def test_the_adaptive_entropy_coefficient_follows_the_measured_entropy():
    loss = PPOClip(entropy_coef=0.01, entropy_target=0.5, entropy_coef_delta=0.005)
    assert loss.entropy_grad and loss.current_entropy_coef() == 0.0  # nothing measured yet: not applied
    loss.end_step(t([0.8, 2.0]))  # mean entropy 0.4 <= 0.5: coefficient up, applied
    assert math.isclose(loss.entropy_coef, 0.015) and math.isclose(loss.current_entropy_coef(), 0.015)
    loss.end_step(t([1.2, 2.0]))  # 0.6 > 0.5: down, and not applied
    assert math.isclose(loss.entropy_coef, 0.01) and loss.current_entropy_coef() == 0.0
    restored = PPOClip(entropy_coef=0.01, entropy_target=0.5)
    restored.load_state_dict(loss.state_dict())
    assert restored.state_dict() == loss.state_dict()


def test_a_negative_entropy_coefficient_minimises_the_entropy():
    """`loss.entropy_coef=-1`: the per-token loss is the surrogate plus the entropy (the positive
    control of the pass@k study), so gradient descent on it makes the distribution sharper."""
    logits = t([[[2.0, 1.0, 0.0], [0.5, 0.5, 0.0]]]).requires_grad_(True)  # [1, 2, V]

    def entropy():  # [1, 2]
        logq = logits.log_softmax(-1)
        return -(logq.exp() * logq).sum(-1)

    logp = logits.log_softmax(-1)[..., 0]  # [1, 2] the sampled token's log-prob
    mask, zero = t([[1, 1]]), t([[0.0, 0.0]])
    before = entropy()
    L, _ = PPOClip(entropy_coef=-1.0)(LossInput(logp, logp.detach(), zero, mask, entropy=before))
    assert torch.allclose(L, before)  # no advantage: the surrogate is 0, the loss the entropy itself
    L.sum().backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    assert (entropy() < before).all()


# ---- TRL's own loss code on the same inputs --------------------------------------------------------------------


class OneProcess:
    """Test double for accelerate's Accelerator with one process: every collective is the identity."""

    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x.reshape(-1) if x.dim() == 0 else x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    gather_for_metrics = gather


def trl_loss(logp0, entropy, inputs, loss_type="dapo", level="token", beta=0.0, **options):
    """TRL's `GRPOTrainer._compute_loss` run on a stand-in trainer: the model forward is replaced by
    the given log-probs and entropies (a test double: the point is TRL's loss arithmetic), one process.
    Returns (loss, d loss / d logp)."""
    logp = logp0.clone().requires_grad_(True)
    args = SimpleNamespace(
        use_bias_correction_kl=False,
        delta=None,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        entropy_target=0.2,
        entropy_coef_delta=0.005,
        entropy_coef_min=0.0,
        entropy_coef_max=1.0,
        steps_per_generation=1,
    )
    for k in list(options):
        if hasattr(args, k):
            setattr(args, k, options.pop(k))
    fake = SimpleNamespace(
        args=args,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.2,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=OneProcess(),
        _metrics={"train": defaultdict(list)},
        aux_loss_enabled=False,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        _entropy_bonus_enabled=False,
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        max_completion_length=logp0.shape[1],
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
    )
    fake.__dict__.update(options)
    fake.get_high_entropy_mask = lambda e, m, q: GRPOTrainer.get_high_entropy_mask(fake, e, m, q)
    n, T = logp0.shape
    base = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, T, dtype=torch.long),
        "num_items_in_batch": inputs["completion_mask"].sum(),
    }
    loss = GRPOTrainer._compute_loss(fake, None, {**base, **inputs})
    loss.backward()
    return loss.detach(), logp.grad, fake


@pytest.fixture
def shared():
    """Random rollout numbers both sides see: 6 rows of up to 7 tokens, sequence advantages."""
    g = torch.Generator().manual_seed(3)
    n, T = 6, 7
    old = -torch.rand(n, T, generator=g, dtype=D) * 2
    return SimpleNamespace(
        old=old,
        logp=old + 0.15 * torch.randn(n, T, generator=g, dtype=D),
        behaviour=old + 0.4 * torch.randn(n, T, generator=g, dtype=D),
        ref=old + 0.2 * torch.randn(n, T, generator=g, dtype=D),
        entropy=torch.rand(n, T, generator=g, dtype=D) * 2,
        adv=torch.randn(n, 1, generator=g, dtype=D),
        mask=(torch.arange(T)[None] < torch.tensor([[7], [3], [5], [1], [6], [4]])).to(D),
    )


def rlkit_loss(s, loss_fn, aggregator, correction=None, select=None, entropy=None):
    logp = s.logp.clone().requires_grad_(True)
    adv = s.adv.expand_as(s.mask)
    w = correction(logp.detach(), s.old, s.behaviour, adv, s.mask)[0] if correction else None
    L, _ = loss_fn(LossInput(logp, s.old, adv, s.mask, s.ref if loss_fn.beta else None, entropy, w, select))
    total = (L * aggregator.token_weights(s.mask)).sum()
    total.backward()
    return total.detach(), logp.grad


def trl_inputs(s, **extra):
    return {"completion_mask": s.mask, "advantages": s.adv[:, 0], "old_per_token_logps": s.old, **extra}


def assert_same(a, b):
    assert torch.allclose(a[0], b[0], rtol=1e-6, atol=1e-12), (float(a[0]), float(b[0]))  # float32 loss weights
    assert torch.allclose(a[1], b[1], rtol=1e-6, atol=1e-12), (a[1] - b[1]).abs().max()


@pytest.mark.parametrize(
    "correction,mode",
    [
        (TokenTIS(c_max=2.0), "token_truncate"),
        (TokenMIS(c_min=0.5, c_max=5.0), "token_mask"),
        (SequenceIS("truncate", "product"), "sequence_truncate"),
        (SequenceIS("mask", "product"), "sequence_mask"),
    ],
)
def test_importance_corrections_weigh_the_loss_as_trl_does(shared, correction, mode):
    """TRL computes its vLLM ratio inside generation (not callable alone), so its ratio is built here
    with rlkit's correction and the test checks how TRL applies it: on the policy term, before the KL."""
    w = correction(shared.logp, shared.old, shared.behaviour, shared.adv.expand_as(shared.mask), shared.mask)[0]
    ratio = w if mode.startswith("token") else w[:, :1]
    ours = rlkit_loss(shared, PPOClip(beta=0.05), TokenMean(), correction)
    theirs = trl_loss(
        shared.logp,
        shared.entropy,
        trl_inputs(shared, importance_sampling_ratio=ratio, ref_per_token_logps=shared.ref),
        beta=0.05,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
    )
    assert_same(ours, theirs[:2])


def test_the_off_policy_sequence_mask_is_trls(shared):
    ours = rlkit_loss(shared, PPOClip(), TokenMean(), OffPolicySequenceMask(delta=0.05))
    theirs = trl_loss(
        shared.logp,
        shared.entropy,
        trl_inputs(shared, sampling_per_token_logps=shared.behaviour),
        off_policy_mask_threshold=0.05,
        use_vllm=True,
    )
    assert_same(ours, theirs[:2])
    dropped = OffPolicySequenceMask(delta=0.05)(
        shared.logp, shared.old, shared.behaviour, shared.adv.expand_as(shared.mask), shared.mask
    )[0]
    assert 0 < int((dropped[:, 0] == 0).sum()) < 6  # the inputs exercise both outcomes


def test_the_importance_weighted_kl_is_trls_bias_corrected_kl(shared):
    ours = rlkit_loss(shared, PPOClip(beta=0.1, kl_is_weighted=True), TokenMean())
    theirs = trl_loss(
        shared.logp,
        shared.entropy,
        trl_inputs(shared, ref_per_token_logps=shared.ref),
        beta=0.1,
        use_bias_correction_kl=True,
    )
    assert_same(ours, theirs[:2])


def test_top_entropy_selection_is_trls(shared):
    loss = PPOClip(top_entropy_quantile=0.3)
    select = loss.token_selection(shared.entropy, shared.mask)
    ours = rlkit_loss(shared, loss, TokenMean(), select=select)
    theirs = trl_loss(shared.logp, shared.entropy, trl_inputs(shared), top_entropy_quantile=0.3)
    assert_same(ours, theirs[:2])


def test_luspo_is_gspo_summed_over_each_sequences_tokens(shared):
    ours = rlkit_loss(shared, GSPO(eps_low=0.2, eps_high=0.2), SeqMeanTokenSum())
    theirs = trl_loss(shared.logp, shared.entropy, trl_inputs(shared), loss_type="luspo", level="sequence")
    assert_same(ours, theirs[:2])


def test_vespo_is_trls_with_and_without_a_correction(shared):
    ours = rlkit_loss(shared, VESPO(), TokenMean())
    theirs = trl_loss(shared.logp, shared.entropy, trl_inputs(shared), loss_type="vespo")
    assert_same(ours, theirs[:2])
    tis = TokenTIS(c_max=2.0)
    ratio = tis(shared.logp, shared.old, shared.behaviour, shared.adv.expand_as(shared.mask), shared.mask)[0]
    ours = rlkit_loss(shared, VESPO(), TokenMean(), tis)
    ratio = ratio.masked_fill(shared.mask == 0, 1.0)  # TRL's ratio is exp(0) on padding
    theirs = trl_loss(
        shared.logp,
        shared.entropy,
        trl_inputs(shared, importance_sampling_ratio=ratio),
        loss_type="vespo",
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
    )
    assert_same(ours, theirs[:2])


def test_the_adaptive_entropy_coefficient_is_trls(shared):
    """Three optimizer steps on the same inputs: the coefficient's path and each step's loss agree."""
    ours = PPOClip(entropy_coef=0.02, entropy_target=1.2, entropy_coef_delta=0.01)
    state = {"entropy_coef": 0.02, "_last_world_entropy": float("inf"), "_entropy_window_stats": None}
    for step, shift in enumerate((0.0, 0.6, -0.5)):
        entropy = (shared.entropy + shift).clamp(min=0)
        mine = rlkit_loss(shared, ours, TokenMean(), entropy=entropy)
        ours.end_step(torch.stack([(entropy * shared.mask).sum(), shared.mask.sum()]))
        theirs = trl_loss(
            shared.logp,
            entropy,
            trl_inputs(shared),
            use_adaptive_entropy=True,
            _entropy_bonus_enabled=True,
            entropy_target=1.2,
            entropy_coef_delta=0.01,
            **state,
        )
        assert_same(mine, theirs[:2])
        fake = theirs[2]
        state = {
            "entropy_coef": fake.entropy_coef,
            "_last_world_entropy": fake._last_world_entropy,
            "_entropy_window_stats": None,
        }
        assert math.isclose(ours.entropy_coef, fake.entropy_coef, rel_tol=1e-12), step
