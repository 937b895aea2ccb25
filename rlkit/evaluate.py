"""Held-out evaluation through the run's generation engine, on the task's fixed evaluation split:
greedy accuracy, and optionally the mean accuracy of k sampled completions per prompt (mean@k),
each overall and per difficulty level."""

from __future__ import annotations

import random
import time
from typing import NamedTuple

import torch

from rlkit import progress
from rlkit.draws import RowDraws
from rlkit.environments import episodes, generate, verdicts
from rlkit.logprobs import demonstration_batch, demonstrations, token_logprobs
from rlkit.metrics import by_difficulty, feature_metrics, hardest_third
from rlkit.metrics import mean_or_none as mean
from rlkit.rewards import correct as right


class Answers(NamedTuple):
    """What the engine wrote for E rows, and how it scored."""

    correct: torch.Tensor  # [E] bool, reward > 0
    lengths: torch.Tensor  # [E] completion tokens
    truncated: torch.Tensor  # [E] bool, no EOS within the budget
    texts: list[str]  # E
    episodes: tuple | list = ()  # E multi-turn episodes as they ended; empty for a single-turn environment
    forced_entropy: torch.Tensor | None = None  # [E, Tf] the entropies before the `forced` tokens; None: not computed


def answers(
    engine,
    tokenizer,
    task,
    rows_all: list[dict],
    batch_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    environment=None,
    keyed: int | None = None,
    n: int = 1,
    forced: tuple | None = None,
) -> Answers:
    """Each row's completion (with a multi-turn `environment`, its whole episode), scored by the
    task's reward. `keyed`: a seed that keys each row's uniforms by its prompt and its index among
    the `n` contiguous rows of that prompt. `forced` (ids, mask [E, Tf]): tokens whose entropies
    after each prompt the engine computes on the same prefill, where it can (single-turn)."""
    correct, lengths, truncated, every, played, entropies = [], [], [], [], [], []
    batches = range(0, len(rows_all), batch_size)
    for start in progress.steps(batches, "rlkit: evaluation, prompt batches", len(batches)):
        rows = rows_all[start : start + batch_size]
        ep = None if environment is None else episodes(environment, rows)
        prompts, index = [r["prompt"] for r in rows], [i % n for i in range(start, start + len(rows))]
        draws = None if keyed is None else RowDraws(keyed, "eval", (), prompts, index)
        f = None if forced is None or ep is not None else tuple(t[start : start + len(rows)] for t in forced)
        gen = generate(engine, prompts, max_new_tokens, temperature, top_p, ep, draws, f)
        entropies.append(gen.forced_entropy)
        texts = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        correct.append(right({}, task.score(rows, texts), None, verdicts(ep)))  # [n]
        lengths.append(gen.completion_mask.sum(-1).float())  # [n]
        truncated.append(gen.truncated)  # [n]
        every += texts
        played += [] if ep is None else ep.each
    forced_entropy = None if None in entropies else torch.cat(entropies)  # [E, Tf]
    return Answers(torch.cat(correct), torch.cat(lengths), torch.cat(truncated), every, played, forced_entropy)


def presence(task, rows: list[dict], texts: list[str]) -> torch.Tensor:
    """Whether each completion holds its row's answer anywhere (the task's lenient `present`).  -> [E]"""
    return torch.tensor([task.present(r, t) for r, t in zip(rows, texts)]).float()


PROBE_SEED = 0  # the probe's demonstrations: the same draws in every evaluation and every run


def probe_tokens(policy, tokenizer, task, rows: list[dict]) -> tuple | None:
    """The probe's demonstrations (`probe_entropy`) as the tokens the greedy pass forces after each
    prompt (`answers`' `forced`): ids and mask [E, Tf]; None where there is no probe."""
    if policy is None or task.demonstration is None:
        return None
    return demonstrations(tokenizer, task, rows, random.Random(PROBE_SEED))


@torch.no_grad()
def probe_entropy(policy, tokenizer, task, batch_size: int) -> dict:
    """`eval/probe_entropy`: the policy's mean per-token entropy (nats, temperature 1) on a fixed
    probe set, each held-out prompt followed by one of the task's own right completions (drawn
    with a fixed seed: the same tokens at every evaluation and in every run), teacher-forced. Unlike
    the rollout's entropy it does not move with what the policy chooses to write. A task without
    demonstrations has no probe (an empty dict)."""
    if policy is None or task.demonstration is None:
        return {}
    rows, rng, device = task.eval.to_list(), random.Random(PROBE_SEED), next(policy.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = [t.to(device) for t in demonstration_batch(tokenizer, task, rows[start : start + batch_size], rng)]
        _, ent = token_logprobs(policy, *batch, entropy="metric", decoded=True)  # [n, Tc]
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
    pass_k=(),
    sample_levels=(),
    policy=None,
    environment=None,
    coupled: bool = False,
    seconds: dict | None = None,
) -> dict:
    """Greedy accuracy, the share of answers that hold the right answer anywhere (`eval/present`,
    the task's lenient score) and mean completion length (tokens) of correct and incorrect answers;
    with `samples` = n > 0 also `eval/mean@n`, the accuracy of n completions per prompt sampled at
    the rollout's temperature, and `eval/pass@k` for each k of `pass_k` (`sample_levels`: for those
    difficulty levels' prompts only, logged per level). The sampling draws from its own generator
    state (`seed`, the same at every evaluation), so it does not move training's random stream, and
    runs draw alike unless `eval.seed_per_run` adds the run's seed to it. Each accuracy is also
    given per difficulty level (`_d<k>`) and over the hardest third of levels (`_hard`).
    With the `policy`, also its entropy on a fixed probe set (`probe_entropy`); with a multi-turn
    `environment`, each answer is an episode and the environment's metrics of the greedy episodes
    come too (`eval/tool_use`, ...). `coupled`: each sample's uniforms keyed by the seed, its
    prompt and its index among the prompt's n (`rlkit.draws`), whatever the batch. `seconds`: a
    dict that receives the seconds of each part (`eval_greedy`, `eval_probe`, `eval_sampled`; the
    probe is part of the greedy pass where the engine computes it on the same prefill, `forced`)."""
    rows_all, clock = task.eval.to_list(), Clock(seconds)
    out = greedy_and_probe(engine, tokenizer, task, rows_all, batch_size, max_new_tokens, policy, environment, clock)
    if samples:
        how = Sampling(batch_size, max_new_tokens, temperature, top_p, seed, environment, coupled)
        out.update(sampled_accuracy(engine, tokenizer, task, rows_all, samples, how, pass_k, sample_levels))
        clock.lap("eval_sampled")
    return out


def greedy_and_probe(engine, tokenizer, task, rows, batch_size: int, max_new_tokens: int, policy, environment, clock):
    """`greedy_metrics` and the probe entropy, computed on the greedy pass's prefill where the engine
    can (`answers`' `forced`), else by the probe's own forward (`probe_entropy`)."""
    forced = probe_tokens(policy, tokenizer, task, rows)
    greedy = answers(engine, tokenizer, task, rows, batch_size, max_new_tokens, environment=environment, forced=forced)
    out = greedy_metrics(task, rows, greedy, environment)
    clock.lap("eval_greedy")
    if greedy.forced_entropy is not None:
        out["eval/probe_entropy"] = float(greedy.forced_entropy.sum() / forced[1].sum())
    else:
        out.update(probe_entropy(policy, tokenizer, task, batch_size))
        clock.lap("eval_probe")
    return out


class Clock:
    """Seconds since the last lap, added to `seconds[name]` at each lap (no dict: not kept)."""

    def __init__(self, seconds: dict | None):
        self.seconds, self.t = seconds, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self.seconds is not None:
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self.t
        self.t = now


def greedy_metrics(task, rows: list[dict], greedy: Answers, environment) -> dict:
    """Accuracy, presence, lengths and features of the greedy answers, and the environment's
    metrics of their episodes."""
    ok, lens, texts = greedy.correct, greedy.lengths, greedy.texts  # [E], [E], E
    present = presence(task, rows, texts)  # [E]
    out = {
        "eval/accuracy": mean(ok.float()),
        "eval/present": mean(present),
        **by_difficulty(rows, present, "eval/present"),
        "eval/len_correct": mean(lens[ok]),
        "eval/len_incorrect": mean(lens[~ok]),
        **by_difficulty(rows, ok.float(), "eval/acc"),
        **hardest_third(rows, ok.float(), "eval/acc"),
        **feature_metrics(task, rows, texts, "eval", hard=True),
    }
    if greedy.episodes:
        out.update({f"eval/{k}": v for k, v in environment.metrics(greedy.episodes, ok).items()})
    return out


def pass_at_k(n: int, correct: torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased pass@k estimator (Chen et al. 2021, arXiv 2107.03374) of each prompt from `correct`
    of its `n` samples right: 1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without
    replacement hold at least one right answer, computed as a product (no large binomials).  [E] -> [E]"""
    i = torch.arange(n - k + 1, n + 1, dtype=torch.float64)  # [k]: n-k+1 .. n
    # C(n-c, k) / C(n, k) = prod_{i=n-k+1}^{n} (i - c) / i; a factor is 0 (i = c) as soon as n - c < k
    miss = ((i[None, :] - correct.double()[:, None]) / i[None, :]).clamp(min=0).prod(-1)  # [E]
    return (1.0 - miss).float()  # [E]


class Sampling(NamedTuple):
    """How sampled answers are drawn: in batches of `batch_size`, `max_new_tokens` each, at
    `temperature` and `top_p`, from the generator state `seed` (`coupled`: from uniforms keyed by
    it, `rlkit.draws`), as `environment`'s episodes (None: single-turn)."""

    batch_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    environment: object = None
    coupled: bool = False


def sampled_accuracy(engine, tokenizer, task, rows: list[dict], n: int, how: Sampling, pass_k=(), levels=()) -> dict:
    """`eval/mean@n` and `eval/pass@k` for each k of `pass_k` (per difficulty level and over the
    hardest third too), from n completions per prompt sampled as `how` says. mean@n is the unbiased
    pass@1. `levels`: only the rows of those difficulty levels are sampled, and only their per-level
    values are given (an overall mean of some levels would read as one of every level)."""
    if levels:
        rows = [r for r in rows if float(r["difficulty"]) in levels]
    hits = sampled_answers(engine, tokenizer, task, rows, n, how).correct.float().view(len(rows), n)  # [E, n]
    out = {}
    for name, per_prompt in (
        (f"eval/mean@{n}", hits.mean(-1)),
        *((f"eval/pass@{k}", pass_at_k(n, hits.sum(-1), k)) for k in pass_k),
    ):
        whole = {} if levels else {name: mean(per_prompt), **hardest_third(rows, per_prompt, name)}
        out.update({**whole, **by_difficulty(rows, per_prompt, name)})
    return out


def sampled_answers(engine, tokenizer, task, rows: list[dict], n: int, how: Sampling) -> Answers:
    """n completions per prompt sampled as `how` says, each prompt's n together (E * n rows)."""
    repeated = [r for r in rows for _ in range(n)]
    keyed = how.seed if how.coupled else None
    with torch.random.fork_rng():
        torch.manual_seed(how.seed)
        return answers(engine, tokenizer, task, repeated, *how[:4], environment=how.environment, keyed=keyed, n=n)


def held_out(run, seconds: dict | None = None) -> dict:
    """`evaluate` of a run (`rlkit.state.Run`) as it stands: the engine's latest weights, the run's
    evaluation settings, the policy's probe entropy."""
    p = run.parts
    return evaluate(
        p.engine.latest(),
        p.tokenizer,
        p.task,
        **run.settings.evaluation,
        policy=p.policy,
        environment=p.environment,
        seconds=seconds,
    )


def timed_eval(run) -> tuple[dict, float]:
    """The held-out evaluation (with the seconds of its parts as `time/eval_greedy`, ...) and its
    seconds, which the run's accounts keep."""
    t, parts = time.perf_counter(), {}
    out = held_out(run, parts)
    seconds = time.perf_counter() - t
    run.runtime.spend("eval", seconds)
    return {**out, **{f"time/{k}": v for k, v in parts.items()}}, seconds
