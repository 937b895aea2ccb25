"""Sampling-support replay (`+engine.replay_support=true`): with top-p, the engine samples from the
nucleus renormalised; it records each token's nucleus, its own log-probs are those of the
renormalised distribution, and the trainer's log-probs of the policy are taken on the same
nucleus, to the token; without top-p nothing changes."""

import json

import pytest
import torch

from conftest import make_cfg
from rlkit.engines.kv_cache import generate
from rlkit.engines.sampling import support_logp
from rlkit.logprobs import token_logprobs
from rlkit.models import TinyQwen2
from rlkit.session import run

PROMPTS = ["1+2=", "3+4+5=", "9=", "2+2+2+2="]
T, TOP_P = 0.8, 0.6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)  # random weights: spread-out distributions, so the nucleus holds several tokens
    return TinyQwen2(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64).build(
        "0123456789+=;", 0
    )


def by_hand(policy, gen):
    """Each completion token's nucleus and renormalised log-prob from the model's own forward over
    prompt + completion (softmax at T, descending, kept while the mass before a token is <= top-p)."""
    nuclei, logps = {}, {}
    for i in range(len(gen.prompt_ids)):
        p = gen.prompt_ids[i][gen.prompt_mask[i].bool()]
        c = gen.completion_ids[i][gen.completion_mask[i].bool()]
        with torch.no_grad():
            logits = policy(torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1].double()  # [tc, V]
        for t, probs in enumerate(torch.softmax(logits / T, -1)):
            top, order = probs.sort(descending=True)
            kept = (top.cumsum(0) - top) <= TOP_P
            nuclei[i, t] = set(order[kept].tolist())
            logps[i, t] = float(torch.log(probs[c[t]] / top[kept].sum()))
    return nuclei, logps


def test_the_replayed_log_prob_is_the_one_the_token_was_drawn_with(model):
    policy, tok = model
    torch.manual_seed(1)
    gen = generate(policy, tok, PROMPTS * 4, 8, T, TOP_P, logprobs=True, support=True)
    nuclei, logps = by_hand(policy, gen)
    with torch.no_grad():
        replayed, _ = token_logprobs(policy, *gen[:4], temperature=T, support=gen.support)  # [N, Tc]
        full, _ = token_logprobs(policy, *gen[:4], temperature=T)  # [N, Tc]
    for (i, t), nucleus in nuclei.items():
        ids = gen.support[i, t]
        assert set(ids[ids >= 0].tolist()) == nucleus and int(gen.completion_ids[i, t]) in nucleus
        assert float(gen.logprobs[i, t]) == pytest.approx(logps[i, t], abs=1e-5)  # the engine's own
        assert float(replayed[i, t]) == pytest.approx(logps[i, t], abs=1e-5)  # the trainer's, on the same nucleus
    gap = (replayed - full)[gen.completion_mask.bool()]  # -log of the nucleus's mass under the full softmax
    assert (gap >= -1e-6).all() and float(gap.max()) > 0.05  # the nucleus left mass out somewhere


def test_a_nucleus_holds_the_whole_renormalised_distribution():
    logp_all = torch.log_softmax(torch.randn(3, 50), -1)  # [3, V]
    support = torch.tensor([[4, 7, -1], [0, 1, 2], [-1, -1, -1]])  # [3, k]; the last: no nucleus recorded
    for r in range(2):
        ids = support[r][support[r] >= 0]  # [k']
        lp = support_logp(logp_all[r].expand(len(ids), -1), logp_all[r, ids], support[r].expand(len(ids), -1))  # [k']
        assert float(lp.exp().sum()) == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(support_logp(logp_all, logp_all[:, 5], support)[2], logp_all[2, 5])  # none: unchanged


def test_without_top_p_nothing_is_recorded(model):
    policy, tok = model
    assert generate(policy, tok, PROMPTS, 6, T, 1.0, support=True).support is None
    assert generate(policy, tok, PROMPTS, 6, 0.0, TOP_P, support=True).support is None  # greedy


@pytest.mark.parametrize("replay", [True, False])
def test_a_run_compares_the_engine_and_the_trainer_on_the_same_distribution(tmp_path, warm_cache, replay):
    """A float32 off-policy engine at staleness 0 samples the trainer's weights: its behaviour
    log-probs and the trainer's old ones agree to float rounding, on the nucleus with replay (where
    the trainer's full-softmax log-probs would differ by the log of the nucleus's mass) and on the
    full softmax without."""
    over = ["steps=2", "engine=off_policy", f"+engine.replay_support={str(replay).lower()}", f"rollout.top_p={TOP_P}"]
    run(make_cfg(over, cache_dir=warm_cache), str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]  # after step 0's
    assert len(lines) == 2 and all(x["offpolicy/abs_log_ratio"] < 1e-5 for x in lines)
