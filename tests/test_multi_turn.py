"""Multi-turn episodes: the engine's turns (the KV cache kept across them), the mask that keeps the
environment's tokens out of log-probs and losses, and training on trajectories with every
estimator and aggregator. The environment is `helpers.Echo`, a plugin for the character testbed
(its reply is made of the testbed's characters); the calculator's episodes are in test_calculator.py
and SmolLM2's chat template in test_smollm2.py."""

import json
import re

import pytest
import torch

from conftest import make_cfg
from helpers import Echo, reprefilled
from rlkit.advantages import GAE
from rlkit.aggregators import SeqMeanTokenMean, SeqMeanTokenSum, TokenMean
from rlkit.engines.kv_cache import generate
from rlkit.environments import SingleTurn, episodes
from rlkit.logprobs import token_logprobs
from rlkit.loop import make_rollout
from rlkit.losses import PPOClip
from rlkit.models import TinyQwen2
from rlkit.refusals import ConfigError
from rlkit.session import run
from rlkit.setup import setup
from rlkit.tasks.arithmetic import ALPHABET
from rlkit.types import Episodes, LossInput, Rollout

PROMPTS = ["1+2=", "13+4+5=", "7+7=", "9+1+0+3="]  # different lengths -> left padding


@pytest.fixture(scope="module")
def model_tok():
    sizes = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model, tok = TinyQwen2(**sizes, max_position_embeddings=128).build(ALPHABET, 0)
    return model.eval(), tok


def play(model, tok, prompts, budget=30, temperature=1.0, max_turns=3, seed=0, **kw):
    torch.manual_seed(seed)
    env = Echo(max_turns)
    ep = episodes(env, [{"prompt": p} for p in prompts])
    return generate(model, tok, prompts, budget, temperature, episodes=ep, **kw), ep


class OneTurn:
    def reply(self, text: str) -> None:
        return None


def test_a_single_turn_environment_leaves_the_engine_on_its_one_turn_path(model_tok):
    """No episodes for a single-turn environment; and episodes that end after their first turn give
    the one-turn path's very tokens, masks and truncation, every token the model's."""
    model, tok = model_tok
    assert episodes(SingleTurn(), [{"prompt": p} for p in PROMPTS]) is None
    torch.manual_seed(0)
    plain = generate(model, tok, PROMPTS * 4, 12)
    torch.manual_seed(0)
    ep = Episodes([OneTurn() for _ in PROMPTS * 4], 2, ())
    turned = generate(model, tok, PROMPTS * 4, 12, episodes=ep)
    assert plain.model_mask is None and all(torch.equal(a, b) for a, b in zip(plain[:5], turned[:5]))
    assert torch.equal(turned.model_mask * turned.completion_mask, turned.completion_mask)


def test_the_environments_tokens_are_its_replies_right_after_each_turn_and_never_the_models(model_tok):
    model, tok = model_tok
    gen, ep = play(model, tok, PROMPTS * 4, logprobs=True)
    echo = tok("9=", add_special_tokens=False)["input_ids"]
    turns_seen = 0
    for i in range(gen.completion_ids.shape[0]):
        n = int(gen.completion_mask[i].sum())
        ids, model_tok_mask = gen.completion_ids[i, :n].tolist(), gen.model_mask[i, :n].tolist()
        j, turns = 0, []
        while j < n:  # walk the trajectory: a model turn, then (maybe) the environment's reply
            start = j
            while j < n and model_tok_mask[j]:
                j += 1
            turns.append(tok.decode(ids[start:j]))
            if j < n:
                assert ids[j : j + len(echo)] == echo and model_tok_mask[j : j + len(echo)] == [0] * len(echo)
                j += len(echo)
        answered = turns[:-1]  # every turn the environment answered ended at ';' or EOS
        assert all(t.endswith(";") or t.endswith(tok.eos_token) for t in answered), turns
        assert len(turns) <= 3 and ep.each[i].turns >= len(turns) - 1
        turns_seen += len(turns)
        assert torch.all(gen.logprobs[i, :n][gen.model_mask[i, :n] == 0] == 0)
    assert turns_seen > gen.completion_ids.shape[0]  # episodes did take several turns


def test_kv_cache_kept_across_turns_gives_the_tokens_of_re_prefilling_the_history(model_tok):
    model, tok = model_tok
    gen, _ = play(model, tok, PROMPTS, budget=24, temperature=0)
    for i, p in enumerate(PROMPTS):
        n = int(gen.completion_mask[i].sum())
        assert gen.completion_ids[i, :n].tolist() == reprefilled(model, tok, p, 24, Echo(3)), p


def test_two_turn_log_probs_equal_a_plain_forward_over_the_whole_conversation(model_tok):
    model, tok = model_tok
    gen, _ = play(model, tok, PROMPTS * 2, budget=24, temperature=0.7, max_turns=2, logprobs=True)
    logp, _ = token_logprobs(model, *gen[:4], temperature=0.7)  # [N, Tc] packed, as training runs it
    for i, p in enumerate(PROMPTS * 2):
        n = int(gen.completion_mask[i].sum())
        seq = torch.cat([tok(p, return_tensors="pt")["input_ids"][0], gen.completion_ids[i, :n]])[None]
        full = torch.log_softmax(model(input_ids=seq).logits[0, -n - 1 : -1] / 0.7, -1)  # [n, V]
        plain = full.gather(-1, gen.completion_ids[i, :n, None]).squeeze(-1)  # [n]
        assert torch.allclose(logp[i, :n], plain, atol=1e-5)
        mine = gen.model_mask[i, :n].bool()
        assert torch.allclose(gen.logprobs[i, :n][mine], plain[mine], atol=1e-5)  # the engine's own, model tokens


def hand_built() -> Rollout:
    """Two trajectories of 6 tokens: model, model, environment, environment, model, (pad) and all
    six the model's (a single-turn answer)."""
    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    model_mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]])
    z = torch.zeros(2, 1, dtype=torch.long)
    r = Rollout(z, z + 1, torch.arange(12).view(2, 6), completion_mask, torch.zeros(2, dtype=torch.bool), 2)
    r.model_mask, r.rewards, r.shaping = model_mask, torch.tensor([1.0, 0.0]), torch.zeros(2)
    return r


def test_the_training_mask_and_the_aggregators_lengths_count_only_the_models_tokens():
    r = hand_built()
    mask = PPOClip().train_mask(r)  # [2, 6]
    assert mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert SeqMeanTokenMean().token_weights(mask)[0].tolist() == pytest.approx([1 / 6, 1 / 6, 0, 0, 1 / 6, 0])
    assert TokenMean().token_weights(mask)[0].tolist() == pytest.approx([1 / 9, 1 / 9, 0, 0, 1 / 9, 0])
    assert SeqMeanTokenSum().token_weights(mask).sum().item() == pytest.approx(9 / 2)


def test_the_loss_does_not_move_with_the_environments_tokens():
    r, loss = hand_built(), PPOClip()
    mask, weights = loss.train_mask(r), SeqMeanTokenMean().token_weights(loss.train_mask(r))

    def total(logp):
        adv, old = torch.ones(2, 6), torch.full((2, 6), -0.1)
        L, _ = loss(LossInput(logp, old, adv, mask))
        return float((L * weights).sum())

    logp = torch.zeros(2, 6)
    moved = logp.clone()
    moved[0, 2:4] = -5.0  # the environment's tokens of row 0
    assert total(logp) == total(moved)
    moved[0, 4] = -5.0  # a model token
    assert total(logp) != total(moved)


def test_gae_skips_the_environments_tokens():
    """The multi-turn row's advantages on its model tokens are those of the same three tokens
    written as one turn (the environment's tokens are not steps)."""
    r, gae = hand_built(), GAE(gamma=0.9, lam=0.8, whiten=False)
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.0], [0.0] * 6])
    adv, returns = gae(r, values)
    flat = hand_built()
    flat.completion_mask, flat.model_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6]), None
    adv_flat, returns_flat = gae(flat, torch.tensor([[0.1, 0.2, 0.3, 0, 0, 0], [0.0] * 6]))
    assert adv[0, [0, 1, 4]].tolist() == pytest.approx(adv_flat[0, :3].tolist())
    assert returns[0, [0, 1, 4]].tolist() == pytest.approx(returns_flat[0, :3].tolist())
    assert adv[0, 2:4].tolist() == [0, 0] and returns[0, 2:4].tolist() == [0, 0]
    # by hand: delta = (0.9*0.2 - 0.1, 0.9*0.3 - 0.2, 1 - 0.3); A_2 = 0.7, A_1 = 0.07 + 0.72*0.7, ...
    assert adv_flat[0, 2].item() == pytest.approx(0.7)
    assert adv_flat[0, 1].item() == pytest.approx(0.07 + 0.72 * 0.7)


ECHO = ["++environment._target_=helpers.Echo", "++environment.max_turns=3", "rollout.max_new_tokens=24"]
SIGNAL = ["rewards=length_bonus", "reward.functions.length.max_chars=8"]  # rewards that differ within a group
VARIANTS = [
    ["advantage=grpo"],
    ["advantage=dr_grpo"],
    ["advantage=rloo"],
    ["advantage=gae", "critic=value"],
    ["advantage=process"],
    ["aggregator=token_mean"],
    ["aggregator=seq_mean_token_sum"],
    ["aggregator=seq_mean_token_sum_norm"],
    ["sampler=dapo", "rollout.group_size=2"],
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0])
def test_every_estimator_aggregator_and_sampler_trains_on_multi_turn_episodes(variant, warm_cache, tmp_path):
    cfg = make_cfg([*ECHO, *SIGNAL, *variant, "eval.every=0", "checkpoint.every=0"], cache_dir=warm_cache)
    summary = run(cfg, str(tmp_path))
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [l["step"] for l in lines] == [0, 1, 2]
    trained = [l for l in lines[1:] if "train/loss" in l]
    assert trained and all(l["train/grad_norm"] > 0 for l in trained), variant  # the update acted
    assert all(1 < l["env/turns"] <= 3 for l in lines[1:]), variant  # episodes of several turns
    if "sampler=dapo" not in variant:  # the rows trained on are the rows generated: trajectories hold the replies
        assert all(l["env/model_tokens"] < l["train/completion_len"] for l in lines[1:]), variant


def test_the_environments_per_turn_terms_are_added_to_each_episodes_reward(warm_cache, tmp_path):
    """The same episodes (the seed fixes them) with and without a per-turn term: the rewards differ by
    the term times the replies of each episode, and correctness is the task's alone."""
    rollouts = []
    for term in (0.0, 0.5):
        cfg = make_cfg([*ECHO, *SIGNAL, f"++environment.turn_reward={term}"], cache_dir=warm_cache)
        state = setup(cfg, str(tmp_path / str(term)), {})
        rollouts.append(make_rollout(state, [state.parts.task.train[i] for i in range(2)]))
    plain, termed = rollouts
    assert torch.equal(plain.completion_ids, termed.completion_ids)
    replies = torch.tensor([min(e.turns, e.max_turns - 1) for e in termed.episodes], dtype=torch.float)  # [N]
    assert replies.sum() > 0
    assert torch.allclose(termed.rewards - plain.rewards, 0.5 * replies)
    assert torch.equal(termed.correct, plain.correct)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["++environment.mode=reply_str"], "reply must return a chat message (a dict with a string role and content)"),
        (["++environment.mode=content_int"], "reply must return a chat message"),
        (["++environment.mode=no_content"], "reply must return a chat message"),
        (["++environment.mode=metrics_list"], "metrics must return a dict of names to numbers (or None), got [1.0]"),
        (["++environment.mode=reply_raises"], "its reply raised ZeroDivisionError: division by zero"),
        (["++environment.mode=start_raises"], "its start raised KeyError: 'difficulty'"),
        (["++environment.max_turns='3'"], "max_turns must be an integer >= 1, got '3'"),
        (["++environment.max_turns=0"], "max_turns must be an integer >= 1, got 0"),
    ],
)
def test_an_environment_plugin_that_breaks_its_contract_is_named_with_what_it_broke(
    fast_cfg, tmp_path, overrides, message
):
    """Each of these once ended in a raw traceback from inside the engine (or, for max_turns 0, ran
    silently); each is now one ConfigError (exit 2) naming the environment's class and the breach."""
    cfg = fast_cfg("++environment._target_=helpers.Breaking", "rollout.max_new_tokens=24", "steps=1", *overrides)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        run(cfg, str(tmp_path))
    assert str(e.value).startswith("environment=helpers.Breaking: ")
