"""A statistic of an empty subset is missing (None, not logged), never 0: one test per metric family."""

import json
import math

import pytest
import torch

from conftest import make_cfg
from helpers import make_rollout
from rlkit.advantages import DrGRPO
from rlkit.aggregators import SeqMeanTokenMean
from rlkit.config import build
from rlkit.evaluate import evaluate, probe_entropy
from rlkit.metrics import rollout_metrics, weight_metrics
from rlkit.sinks import JsonlLogger


def test_lengths_of_a_subset_with_no_member_are_missing():
    r = make_rollout([0.0, 0.0, 0.0, 0.0], G=2, lengths=[1, 3, 2, 2], T=3)  # nothing correct
    m = rollout_metrics(r, DrGRPO()(r))
    assert m["train/len_correct"] is None and m["train/len_incorrect"] == 2.0
    assert m["train/adv_std"] == 0.0 and m["train/reward"] == 0.0  # all-zero advantages: a real 0, not a missing one
    one = make_rollout([1.0], G=1, lengths=[1], T=3)  # one row of one token
    m = rollout_metrics(one, torch.zeros(1, 3))
    assert m["train/reward_std"] is None and m["train/adv_std"] is None and m["train/len_incorrect"] is None


def test_weight_shares_are_missing_when_no_token_carries_weight():
    r = make_rollout([1.0, 1.0, 0.0, 0.0], G=2, lengths=[1, 3, 2, 2], T=3)  # each group flat: zero advantage
    r.rows = [{"difficulty": 2}] * 2 + [{"difficulty": 5}] * 2
    m = weight_metrics(r, DrGRPO()(r), SeqMeanTokenMean().token_weights(r.completion_mask))
    assert m["weight/share_d2"] is None and m["weight/share_d5"] is None
    assert m["weight/correct_sum"] == 0.0  # a sum over rows that exist is 0, not missing


def test_loggers_leave_missing_values_out(tmp_path):
    log = JsonlLogger(str(tmp_path), {})
    log.log(1, {"train/len_correct": None, "train/reward": 0.0, "train/x": float("nan")})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "train/reward": 0.0, "train/x": "nan"}


def test_evaluation_reports_greedy_and_sampled_accuracy_per_difficulty_on_a_fixed_set(tmp_path):
    cfg = make_cfg(["task=arithmetic_wide", "task.n_train=64", "task.n_eval=24", "task.max_terms=4"])
    task, other_seed = (
        build(cfg, "task"),
        build(
            make_cfg(["task=arithmetic_wide", "task.n_train=64", "task.n_eval=24", "task.max_terms=4", "seed=7"]),
            "task",
        ),
    )
    assert task.eval.to_list() == other_seed.eval.to_list()  # the evaluation set does not follow the run's seed
    policy, tokenizer = build(cfg, "model").build(task.alphabet, seed=0)
    for p in policy.parameters():  # all logits equal: greedy decoding writes padding, never a correct answer
        torch.nn.init.zeros_(p)
    engine = build(cfg, "engine", policy=policy, tokenizer=tokenizer)
    torch.manual_seed(3)
    expected_next = torch.rand(1)
    torch.manual_seed(3)
    out = evaluate(engine, tokenizer, task, batch_size=16, max_new_tokens=4, samples=3, seed=0)
    assert torch.equal(torch.rand(1), expected_next)  # sampling at evaluation leaves training's random stream alone
    assert out == evaluate(engine, tokenizer, task, batch_size=16, max_new_tokens=4, samples=3, seed=0)
    levels = {r["difficulty"] for r in task.eval}
    assert {f"eval/acc_d{d}" for d in levels} | {f"eval/mean@3_d{d}" for d in levels} <= set(out)
    assert all(v is None or 0 <= v <= 1 for k, v in out.items() if "acc" in k or "mean@" in k)
    assert out["eval/accuracy"] == 0.0 and out["eval/len_correct"] is None and out["eval/len_incorrect"] == 4.0
    assert "eval/probe_entropy" not in out  # no policy given: no probe
    probe = probe_entropy(policy, tokenizer, task, batch_size=5)  # all logits equal: log V nats at every token
    assert probe["eval/probe_entropy"] == pytest.approx(math.log(policy.config.vocab_size), rel=1e-6)


def test_the_probe_entropy_is_a_plain_forwards_mean_token_entropy_on_fixed_demonstrations():
    import random

    from rlkit.logprobs import demonstration_batch

    cfg = make_cfg(["task.n_train=64", "task.n_eval=12"])
    task = build(cfg, "task")
    policy, tokenizer = build(cfg, "model").build(task.alphabet, seed=0)  # random weights: entropies differ by token
    rows, rng, total, count = task.eval.to_list(), random.Random(0), 0.0, 0
    pid, pmask, cid, cmask = demonstration_batch(tokenizer, task, rows, rng)  # the same draws, one batch
    with torch.no_grad():
        for i in range(len(rows)):
            p, c = pid[i][pmask[i].bool()], cid[i][cmask[i].bool()]
            logits = policy(torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1]  # [tc, V]
            total += float(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).sum())
            count += len(c)
    first = probe_entropy(policy, tokenizer, task, batch_size=5)["eval/probe_entropy"]
    assert first == pytest.approx(total / count, rel=1e-5)
    assert probe_entropy(policy, tokenizer, task, batch_size=12)["eval/probe_entropy"] == pytest.approx(first, rel=1e-6)


def test_the_probe_on_the_greedy_passs_prefill_is_the_probes_own_forward():
    """The engine forces the probe's demonstrations after each prompt on the greedy pass's prefill:
    the same entropy as the probe's own forward, the same greedy answers; a budget too short for
    the demonstrations runs the probe's own forward."""
    from rlkit.evaluate import probe_tokens

    cfg = make_cfg(["task.n_train=64", "task.n_eval=12"])
    task = build(cfg, "task")
    policy, tokenizer = build(cfg, "model").build(task.alphabet, seed=0)  # random weights: entropies differ by token
    engine = build(cfg, "engine", policy=policy, tokenizer=tokenizer)
    own = probe_entropy(policy, tokenizer, task, batch_size=5)["eval/probe_entropy"]
    Tf = probe_tokens(policy, tokenizer, task, task.eval.to_list())[0].shape[1]
    assert Tf > 1
    for budget, folded in ((Tf + 2, True), (Tf - 1, False)):
        seconds = {}
        out = evaluate(engine, tokenizer, task, batch_size=5, max_new_tokens=budget, policy=policy, seconds=seconds)
        assert ("eval_probe" not in seconds) == folded
        assert out.pop("eval/probe_entropy") == pytest.approx(own, rel=1e-5)
        assert out == evaluate(engine, tokenizer, task, batch_size=5, max_new_tokens=budget)  # no policy: no probe


def test_update_metrics_leave_out_what_no_token_or_step_measured():
    from rlkit.metrics import update_metrics
    from rlkit.types import UpdateStats

    measured = UpdateStats(sums={"clip_frac_high": 3.0}, tokens=12.0, losses=[1.0, 2.0], grad_norms=[4.0, 6.0])
    assert update_metrics(measured) == {"train/clip_frac_high": 0.25, "train/loss": 1.5, "train/grad_norm": 5.0}
    every_row_dropped = UpdateStats(sums={"clip_frac_high": 0.0}, tokens=0.0, losses=[0.0], grad_norms=[0.0])
    assert "train/clip_frac_high" not in update_metrics(every_row_dropped)  # missing, not 0
    skipped = UpdateStats(True, {"kl": 1.0}, 4.0, losses=[1.0], grad_norms=[1.0], value_losses=[0.5])
    assert update_metrics(skipped) == {"train/value_loss": 0.5}


def test_a_level_weighted_accuracy_scales_that_levels_dr_grpo_advantages_and_leaves_grpos():
    """`rewards=level_weighted` scores a right answer of difficulty 4 as 4: a Dr. GRPO group of that
    level gets 4 times the advantages of the same answers at another level, GRPO the same advantages
    (its std division is scale-free); right and wrong are unchanged."""
    from rlkit.advantages import GRPO
    from rlkit.refusals import ConfigError
    from rlkit.rewards import Accuracy, correct, score

    cfg = make_cfg(["task=graded", "task.n_eval=1", "rewards=level_weighted"])
    task, fns = build(cfg, "task"), {name: build(cfg, f"reward.functions.{name}") for name in cfg.reward.functions}
    rows = [{"answer": "7", "difficulty": d} for d in (4, 4, 4, 2, 2, 2)]  # two groups of 3
    texts = ["The answer is 7.", "no", "The answer is 8."] * 2
    rewards, parts = score(task, fns, "sum", rows, texts, 3)
    assert rewards.tolist() == [4.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert correct(fns, rewards, parts).tolist() == [True, False, False] * 2
    r = make_rollout(rewards.tolist(), G=3, lengths=[2] * 6, T=2)
    dr, grpo = DrGRPO()(r)[:, 0].view(2, 3), GRPO()(r)[:, 0].view(2, 3)  # [P, G]
    assert torch.allclose(dr[0], 4 * dr[1]) and dr[1].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert torch.allclose(grpo[0], grpo[1], atol=1e-6)
    with pytest.raises(ConfigError, match="weights must be > 0"):
        Accuracy(by_difficulty={4: 0})


def test_right_and_wrong_are_the_tasks_score_not_the_shaped_reward():
    """A length bonus pays a long wrong answer (reward 0.5 > 0); it still counts as wrong in
    train/acc, the length metrics, the all-correct groups and the weight split."""
    from rlkit.rewards import Accuracy, LengthPenalty, correct

    fns = {"accuracy": Accuracy(), "length": LengthPenalty(max_chars=60, weight=-0.5)}
    parts = torch.tensor([[1.0, 0.0], [0.0, -1.0], [0.0, 0.0], [1.0, -0.5]])  # [N, K] each term's score
    rewards = parts @ torch.tensor([1.0, -0.5])  # [N] 1, 0.5, 0, 1.25: all but one above 0
    assert correct(fns, rewards, parts).tolist() == [True, False, False, True]
    assert correct({}, torch.tensor([0.0, 1.0]), None).tolist() == [False, True]  # the task's own reward
    r = make_rollout(rewards.tolist(), G=2, lengths=[3, 9, 5, 4], T=9)
    shaped = rollout_metrics(r, DrGRPO()(r))
    assert shaped["train/len_incorrect"] == 5.0 and shaped["train/frac_all_correct_groups"] == 0.5  # reward > 0
    r.correct = correct(fns, rewards, parts)
    m = rollout_metrics(r, DrGRPO()(r))
    assert m["train/len_incorrect"] == 7.0 and m["train/len_correct"] == 3.5
    assert m["train/frac_all_correct_groups"] == 0.0 and m["train/frac_all_wrong_groups"] == 0.0
    weights = SeqMeanTokenMean().token_weights(r.completion_mask)
    w = weight_metrics(r, DrGRPO()(r), weights)
    assert w["weight/incorrect_sum"] == pytest.approx(float((DrGRPO()(r) * weights)[1:3].sum()))
