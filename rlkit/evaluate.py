"""Held-out evaluation through the run's generation engine, on the task's fixed evaluation split:
greedy accuracy, and optionally the mean accuracy of k sampled completions per prompt (mean@k),
each overall and per difficulty level."""

from __future__ import annotations

import random
import sys

import torch
from tqdm import tqdm

from rlkit.logprobs import token_logprobs
from rlkit.metrics import by_difficulty, feature_metrics, hardest_third
from rlkit.metrics import mean_or_none as mean


def answers(
    engine,
    tokenizer,
    task,
    rows_all: list[dict],
    batch_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Whether each row's completion is correct (reward > 0), its length in tokens, and its text.  -> [E], [E], E"""
    correct, lengths, every = [], [], []
    for start in tqdm(range(0, len(rows_all), batch_size), desc="rlkit eval", file=sys.stderr, leave=False):
        rows = rows_all[start : start + batch_size]
        gen = engine.generate([r["prompt"] for r in rows], max_new_tokens, temperature, top_p)
        texts = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        correct.append(task.score(rows, texts) > 0)  # [n]
        lengths.append(gen.completion_mask.sum(-1).float())  # [n]
        every += texts
    return torch.cat(correct), torch.cat(lengths), every  # [E], [E], E


@torch.no_grad()
def probe_entropy(policy, tokenizer, task, batch_size: int) -> dict:
    """`eval/probe_entropy`: the policy's mean per-token entropy (nats, temperature 1) on a fixed
    probe set, each held-out prompt followed by one of the task's own right completions (drawn
    with a fixed seed: the same tokens at every evaluation and in every run), teacher-forced. Unlike
    the rollout's entropy it does not move with what the policy chooses to write. A task without
    demonstrations has no probe (an empty dict)."""
    if policy is None or task.demonstration is None:
        return {}
    from rlkit.warm_start import demonstration_batch

    rows, rng, device = task.eval.to_list(), random.Random(0), next(policy.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = [t.to(device) for t in demonstration_batch(tokenizer, task, rows[start : start + batch_size], rng)]
        _, ent = token_logprobs(policy, *batch, entropy="metric")  # [n, Tc]
        total, count = total + float((ent * batch[3]).sum()), count + int(batch[3].sum())
    return {"eval/probe_entropy": total / count}


@torch.no_grad()
def evaluate(
    engine,
    tokenizer,
    task,
    batch_size: int,
    max_new_tokens: int,
    samples: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    policy=None,
) -> dict:
    """Greedy accuracy and mean completion length (tokens) of correct and incorrect answers; with
    `samples` = k > 0 also `eval/mean@k`, the accuracy of k completions per prompt sampled at the
    rollout's temperature. The sampling draws from its own generator state (`seed`, the same at
    every evaluation), so it neither moves training's random stream nor differs between runs. Each
    accuracy is also given per difficulty level (`_d<k>`) and over the hardest third of levels (`_hard`).
    With the `policy`, also its entropy on a fixed probe set (`probe_entropy`)."""
    rows_all = task.eval.to_list()
    ok, lens, texts = answers(engine, tokenizer, task, rows_all, batch_size, max_new_tokens)  # [E], [E], E
    out = {
        "eval/accuracy": mean(ok.float()),
        "eval/len_correct": mean(lens[ok]),
        "eval/len_incorrect": mean(lens[~ok]),
        **by_difficulty(rows_all, ok.float(), "eval/acc"),
        **hardest_third(rows_all, ok.float(), "eval/acc"),
        **feature_metrics(task, rows_all, texts, "eval", hard=True),
    }
    out.update(probe_entropy(policy, tokenizer, task, batch_size))
    if samples:
        options = batch_size, max_new_tokens, temperature, top_p, seed
        out.update(sampled_accuracy(engine, tokenizer, task, rows_all, samples, *options))
    return out


def sampled_accuracy(
    engine, tokenizer, task, rows: list[dict], k: int, batch_size, max_new_tokens, temperature, top_p, seed
) -> dict:
    """`eval/mean@k` (per difficulty level and over the hardest third too): the accuracy of k
    completions per prompt sampled at `temperature`, drawn from the generator state `seed`."""
    repeated = [r for r in rows for _ in range(k)]  # E * k rows, each prompt's k together
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hit, _, _ = answers(engine, tokenizer, task, repeated, batch_size, max_new_tokens, temperature, top_p)
    per_prompt = hit.float().view(len(rows), k).mean(-1)  # [E]
    name = f"eval/mean@{k}"
    return {name: mean(per_prompt), **by_difficulty(rows, per_prompt, name), **hardest_third(rows, per_prompt, name)}
