"""The RL loop: `step` runs four phases, written out below in the order they run: `collect` (sample prompts,
generate, score), `prepare` (reference and old log-probs, critic values, KL in the reward,
advantages), `update` (epochs x mini-batches x micro-batches) and `measure` (the step's metrics);
then, when due, the held-out evaluation and the log line. Each phase takes the parts it uses, the
runtime and its own sub-config. A run's life as a process (process group, lock, signals, the steps,
checkpoints, summary) is `rlkit.session`."""

from __future__ import annotations

import sys
from functools import partial

import torch
from omegaconf import DictConfig
from transformers.utils import logging as hf_logging

from rlkit import parallel
from rlkit.batching import micro_batches, mini_batches, over_micro_batches
from rlkit.config import shuffle_mode
from rlkit.critic import explained_variance
from rlkit.evaluate import evaluate
from rlkit.guards import checked_advantages, finite
from rlkit.logprobs import rollout_logprobs
from rlkit.metrics import kept_metrics, mean_or_none, mismatch_metrics, samples, update_metrics, weight_metrics
from rlkit.rewards import overlong_penalty, score, shuffled, step_reward_matrix
from rlkit.setup import eval_options
from rlkit.state import Parts, Run, Runtime
from rlkit.types import Batch, LossInput, Rollout, UpdateStats

hf_logging.disable_progress_bar()


# ---- 1. collect: P prompts from the sampler, G completions each from the engine, scored -------------------------


def collect(parts: Parts, rt: Runtime, R: DictConfig, reward: DictConfig) -> tuple[Rollout, dict]:
    """A rollout from the sampler (`R`: the rollout config; `reward`: the reward config), and the
    metrics of everything generated, kept or not."""
    parts.policy.eval()
    generated = []  # every rollout the sampler asked for, kept or not

    def make(rows: list[dict]) -> Rollout:
        generated.append(make_rollout(parts, rt, R, reward, rows))
        return generated[-1]

    rollout, metrics = parts.sampler.sample(make)
    if parts.engine.lag is not None:  # updates between the sampled weights and the trainer's
        metrics["offpolicy/lag"] = parts.engine.lag
    metrics["train/gen_tokens"] = sum(int(r.completion_mask.sum()) for r in generated)
    metrics["train/reward_all"] = mean_or_none(torch.cat([r.rewards for r in generated]))  # kept or not
    return rollout, metrics


def make_rollout(parts: Parts, rt: Runtime, R: DictConfig, reward: DictConfig, rows: list[dict]) -> Rollout:
    """G completions of each of this process's share of `rows`, decoded and scored."""
    G, world, timeout = R.group_size, rt.parallel.world, reward.timeout_s
    rows = [row for row in parallel.shard(rows, rt.rank, world) for _ in range(G)]  # N rows, groups contiguous
    with rt.timer("generate"):
        gen = parts.engine.generate([r["prompt"] for r in rows], R.max_new_tokens, R.temperature, R.top_p)
    with rt.timer("score"):
        texts = parts.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        rewards, by_fn = score(parts.task, parts.reward_fns, reward.combine, rows, texts, G, timeout)  # [N], [N, K]
        rewards = shuffled(rewards, G, shuffle_mode(reward.shuffle)).to(rt.device)  # [N] the control: unrelated rewards
        r = Rollout.from_generation(gen, G, rows=rows, texts=texts, rewards=rewards, reward_parts=by_fn)
        if reward.overlong_cache:
            r.shaping = overlong_penalty(r.lengths, R.max_new_tokens, reward.overlong_cache)  # [N]
        if parts.advantage.needs_step_rewards:
            steps = parts.task.score_steps(rows, texts, timeout)
            r.step_rewards, r.step_mask = step_reward_matrix(
                steps, r.completion_ids, r.completion_mask, parts.tokenizer
            )
    return r


# ---- 2. prepare: forwards needed before the update, then advantages ----------------------------------------------


def prepare(parts: Parts, rt: Runtime, O: DictConfig, temperature: float, rollout: Rollout) -> Batch:
    """`O`: the optim config (epochs, mini- and micro-batches); `temperature`: the rollout's."""
    loss = parts.loss
    rows = micro_batches(rollout, torch.arange(rollout.num_rows), O.micro_batch_size, O.micro_batch_tokens)

    def forward(model, entropy: str = "none"):  # -> (logp, entropy) [N, Tc] each; (None, None) without a model
        if model is None:
            return None, None
        fn = partial(rollout_logprobs, model, temperature=temperature, entropy=entropy, share=O.share_prefix)
        return over_micro_batches(fn, rollout, rows, outputs=2)

    with rt.timer("logprob"):
        ref_logp = forward(parts.ref)[0]  # [N, Tc]
        old_model = parts.policy if needs_old_logprobs(parts, O) else None  # None: the update's own, detached
        old_logp, entropy = forward(old_model, "metric" if loss.selects_tokens else "none")  # [N, Tc] each
        values = over_micro_batches(parts.critic.values, rollout, rows) if parts.critic is not None else None  # [N, Tc]
    if loss.kl_in_reward:
        rollout.kl_penalty = loss.kl_penalty(old_logp, ref_logp)  # [N, Tc]
    adv, returns = checked_advantages(parts.advantage, rollout, values)  # [N, Tc] each
    mask = loss.train_mask(rollout)  # [N, Tc]
    select = loss.token_selection(entropy, mask) if loss.selects_tokens else None  # [N, Tc]
    return Batch(rollout, mask, adv, returns, old_logp, ref_logp, values, select)


def needs_old_logprobs(parts: Parts, O: DictConfig) -> bool:
    """Whether the old log-probs need a forward of their own: they come free from the update itself
    unless the rollout is reused, the KL sits in the reward, the engine's numbers are not the
    trainer's, or the loss selects tokens by their entropy."""
    reused = O.epochs > 1 or O.mini_batches > 1
    return reused or parts.loss.kl_in_reward or parts.loss.selects_tokens or not parts.engine.exact_logprobs


# ---- 3. update: epochs x mini-batches (by groups) x micro-batches; the critic on the same mini-batches ------------


def update(parts: Parts, rt: Runtime, O: DictConfig, temperature: float, batch: Batch) -> UpdateStats:
    stats = UpdateStats(skipped=parallel.any_rank(not finite(batch.adv)))
    parts.policy.train()
    with rt.timer("update"):
        for rows in [] if stats.skipped else mini_batches(batch.rollout, O.epochs, O.mini_batches):
            if not policy_step(parts, rt, O, temperature, batch, rows, stats):
                break
            if parts.critic is not None:
                stats.value_losses.append(
                    parts.critic.update(
                        batch.rollout.select_rows(rows), batch.old_values[rows], batch.returns[rows], batch.mask[rows]
                    )
                )
        if stats.grad_norms:  # the warm-up counts updates, not skipped steps
            parts.schedule.step()
            parts.engine.load_weights(parts.policy)
    return stats


def policy_step(
    parts: Parts, rt: Runtime, O: DictConfig, temperature: float, batch: Batch, rows: torch.Tensor, stats: UpdateStats
) -> bool:
    """One optimizer step on `rows`, accumulated over micro-batches; False (and no step) when the
    loss or the gradient norm is not finite."""
    weights = parallel.global_weights(parts.aggregator, batch.mask[rows])  # [n, Tc] normalised over the mini-batch
    parts.optimizer.zero_grad(set_to_none=True)
    total, entropy_sums = 0.0, torch.zeros(2)  # the selected tokens' entropy sum and count (adaptive coefficient)
    for micro in micro_batches(batch.rollout, rows, O.micro_batch_size, O.micro_batch_tokens):
        x, corrected = loss_input(parts, O.share_prefix, temperature, batch, rows[micro])
        L, info = parts.loss(x)  # [m, Tc]
        loss = (L * weights[micro]).sum()
        if not finite(loss.detach()):
            stats.skipped = True
            break
        loss.backward()
        total += float(loss.detach())
        entropy = x.entropy.detach()  # [m, Tc]
        stats.add({**info, **corrected, "entropy": entropy}, x.mask)
        counted = x.mask if x.select is None else x.mask * x.select  # [m, Tc]
        entropy_sums += torch.stack([(entropy * counted).sum(), counted.sum()]).cpu()
    if not finish_step(parts, rt, O.max_grad_norm, stats, total):
        return False
    parts.loss.end_step(entropy_sums)
    return True


def loss_input(parts: Parts, share: str, temperature: float, batch: Batch, idx: torch.Tensor) -> tuple[LossInput, dict]:
    """Rows `idx` of the batch as the loss takes them: the policy's forward (with gradient) and the
    correction's weights, with the correction's statistics."""
    r, adv, mask = batch.rollout.select_rows(idx), batch.adv[idx], batch.mask[idx]  # [m, Tc] each
    entropy_kind = "grad" if parts.loss.entropy_grad else "metric"
    logp, entropy = rollout_logprobs(parts.policy, r, temperature, entropy_kind, share=share)  # [m, Tc] each
    old = logp.detach() if batch.old_logp is None else batch.old_logp[idx]  # [m, Tc]
    behaviour = old if r.behaviour_logp is None else r.behaviour_logp  # [m, Tc] what the engine sampled with
    is_weight, corrected = parts.correction(logp.detach(), old, behaviour, adv, mask)  # [m, Tc]
    ref = batch.ref_logp[idx] if batch.ref_logp is not None else None  # [m, Tc]
    select = batch.select[idx] if batch.select is not None else None  # [m, Tc]
    return LossInput(logp, old, adv, mask, ref, entropy, is_weight, select), corrected


def finish_step(parts: Parts, rt: Runtime, max_grad_norm: float, stats: UpdateStats, total: float) -> bool:
    """Reduce the gradients over the processes, clip, and step unless anything is non-finite."""
    rt.parallel.reduce_gradients(parts.policy.parameters())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parts.policy.parameters(), max_grad_norm))
    if parallel.any_rank(stats.skipped) or not finite(grad_norm):
        stats.skipped = True
        parts.optimizer.zero_grad(set_to_none=True)
        return False
    stats.losses.append(float(parallel.total(torch.tensor(total))))  # every rank's share of the loss
    stats.grad_norms.append(grad_norm)
    parts.optimizer.step()
    return True


# ---- 4. measure: the step's metrics -------------------------------------------------------------------------------


def measure(
    parts: Parts, rt: Runtime, step: int, rollout: Rollout, batch: Batch | None, stats: UpdateStats, metrics: dict
) -> dict:
    if stats.skipped:
        metrics["train/nonfinite_skipped"] = 1
        print(f"rlkit: step {step}: non-finite advantage, loss or gradient norm; update skipped", file=sys.stderr)
    if batch is None:
        metrics["train/skipped_empty_batch"] = 1
    elif rollout.num_rows:  # under data parallel, dynamic sampling may keep nothing on this rank alone
        metrics.update(kept_metrics(parts.task, list(parts.reward_fns), rollout, batch.adv))
        band = parts.correction.c_min, parts.correction.c_max  # the engine's numbers vs the trainer's
        metrics.update(mismatch_metrics(batch.old_logp, rollout.behaviour_logp, rollout.completion_mask, *band))
    if batch is not None and not stats.skipped:
        weights = parallel.global_weights(parts.aggregator, batch.mask)  # [N, Tc] every rank takes part
        if rollout.num_rows:
            metrics.update(weight_metrics(rollout, batch.adv, weights))
    metrics.update(update_metrics(stats))
    if stats.value_losses:
        metrics["train/explained_variance"] = explained_variance(batch.old_values, batch.returns, batch.mask)
    metrics.update(parts.task.step_metrics())
    metrics.update({f"time/{k}": v for k, v in rt.timer.items()})
    metrics["perf/tokens_per_s"] = float(rollout.completion_mask.sum()) / rt.timer["step"]
    return metrics


# ---- the loop ----------------------------------------------------------------------------------------------------


def step(run: Run, n: int) -> tuple[dict, UpdateStats]:
    """Step `n`: the four phases, the held-out evaluation when due, the log line and sample
    completions. Returns the logged metrics and the update's statistics."""
    cfg, parts, rt = run.cfg, run.parts, run.runtime
    rt.timer.clear()
    with rt.timer("step"):
        rollout, metrics = collect(parts, rt, cfg.rollout, cfg.reward)
        kept = parallel.any_rank(rollout.num_rows > 0)  # dynamic sampling may keep nothing
        batch, stats = prepare_and_update(run, rollout) if kept else (None, UpdateStats())
    metrics = measure(parts, rt, n, rollout, batch, stats, metrics)
    if n == cfg.steps or (cfg.eval.every and n % cfg.eval.every == 0):
        engine, options = parts.engine.latest(), eval_options(cfg)
        run.progress.last_eval = evaluate(engine, parts.tokenizer, parts.task, **options, policy=parts.policy)
        metrics.update(run.progress.last_eval)
    metrics = parallel.mean_metrics(metrics)
    rt.logger.log(n, metrics)  # metrics without a value (None) are left out
    if cfg.samples_every and batch is not None and (n % cfg.samples_every == 0 or n == 1):
        rt.logger.log_samples(n, samples(rollout, batch.adv, per_group=2))
    return metrics, stats


def prepare_and_update(run: Run, rollout: Rollout) -> tuple[Batch, UpdateStats]:
    """Phases 2 and 3 on a collected rollout."""
    O, temperature = run.cfg.optim, run.cfg.rollout.temperature
    batch = prepare(run.parts, run.runtime, O, temperature, rollout)
    return batch, update(run.parts, run.runtime, O, temperature, batch)
