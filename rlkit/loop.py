"""The RL loop: `step` runs four phases, written out below in the order they run: `collect` (sample prompts,
generate, score), `prepare` (reference and old log-probs, critic values, KL in the reward,
advantages), `update` (epochs x mini-batches x micro-batches) and `measure` (the step's metrics);
`report` then runs the held-out evaluation when due and writes the log line. Each phase takes the
run and the data of the phase before and hands its own on; settings are `run.settings`, read from
the config once.
A run's life as a process (process group, lock, signals, checkpoints, summary) is `rlkit.session`."""

from __future__ import annotations

import sys

import torch

from rlkit import parallel
from rlkit.critic import explained_variance
from rlkit.draws import RowDraws
from rlkit.environments import episodes, generate, turn_rewards, verdicts
from rlkit.evaluate import timed_eval
from rlkit.guards import checked_advantages
from rlkit.logprobs import rollout_logprobs
from rlkit.metrics import generated_metrics, kept_metrics, mismatch_metrics, samples, update_metrics, weight_metrics
from rlkit.rewards import correct, overlong_penalty, score, shuffled, step_reward_matrix
from rlkit.state import Run
from rlkit.tensors import finite
from rlkit.types import Batch, LossInput, Rollout, StepResult, UpdateStats

# ---- 1. collect: P prompts from the sampler, G completions each from the engine, scored -------------------------


def collect(run: Run) -> tuple[Rollout, dict]:
    """A rollout from the sampler, and the metrics of everything generated, kept or not."""
    run.parts.policy.eval()
    generated = []  # every rollout the sampler asked for, kept or not

    def make(rows: list[dict]) -> Rollout:
        generated.append(make_rollout(run, rows))
        return generated[-1]

    rollout, metrics = run.parts.sampler.sample(make)
    if run.parts.engine.lag is not None:  # updates between the sampled weights and the trainer's
        metrics["offpolicy/lag"] = run.parts.engine.lag
    metrics.update(generated_metrics(run.parts.environment, generated))  # tokens, reward, episodes: kept or not
    return rollout, metrics


def make_rollout(run: Run, rows: list[dict]) -> Rollout:
    """G completions of each of this process's share of `rows`, decoded and scored."""
    parts, rt, s = run.parts, run.runtime, run.settings
    G, timeout, mine = s.group_size, s.score_timeout_s, parallel.shard(rows, rt.rank, rt.parallel.world)
    rows = [row for row in mine for _ in range(G)]  # N rows, groups contiguous
    ep = episodes(parts.environment, rows)  # one multi-turn episode per row, run by the engine; None: single-turn
    prompts = [r["prompt"] for r in rows]
    draws = None if s.coupled is None else RowDraws.of_groups(s.coupled, "rollout", rt.request(), prompts, G)
    with rt.timer("generate"):
        gen = generate(parts.engine, prompts, s.max_new_tokens, s.temperature, s.top_p, ep, draws)
    extra = turn_rewards(ep.each) if ep is not None else None  # [N] the environment's per-turn terms
    with rt.timer("score"):
        texts = parts.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        rewards, by_fn = score(parts.task, parts.reward_fns, s.combine, rows, texts, G, timeout, rt.timer)  # [N], [N,K]
        right = correct(parts.reward_fns, rewards, by_fn, verdicts(ep)).to(rt.device)  # [N] before any shuffling
        rewards = rewards if extra is None else rewards + extra  # [N]
        rewards = shuffled(rewards, G, s.shuffle).to(rt.device)  # [N] the control: unrelated rewards
        kept = dict(rows=rows, texts=texts, episodes=[] if ep is None else ep.each, reward_parts=by_fn, correct=right)
        if s.overlong_cache:
            lengths = gen.completion_mask.sum(-1)  # [N]
            kept["shaping"] = overlong_penalty(lengths, s.max_new_tokens, s.overlong_cache)  # [N]
        if parts.advantage.needs_step_rewards:
            steps = parts.task.score_steps(rows, texts, timeout)
            shape = gen.completion_ids, gen.completion_mask, parts.tokenizer
            kept["step_rewards"], kept["step_mask"] = step_reward_matrix(steps, *shape)  # [N, Tc] each
    return Rollout.from_generation(gen, G, rewards=rewards, **kept)


# ---- 2. prepare: forwards needed before the update, then advantages ----------------------------------------------


def prepare(run: Run, rollout: Rollout) -> Batch:
    """The reference's and the old policy's log-probs and the critic's values where needed, then
    the advantages, the tokens trained on and the tokens selected."""
    parts, s, loss = run.parts, run.settings, run.parts.loss
    rows = rollout.micro_batches(torch.arange(rollout.num_rows), s.micro_batch_size, s.micro_batch_tokens)

    def forward(model, entropy: str = "none"):  # -> (logp, entropy) [N, Tc] each; (None, None) without a model
        if model is None:
            return None, None
        return rollout.over_micro_batches(lambda r: logprobs(run, model, r, entropy), rows, outputs=2)

    with run.runtime.timer("logprob"):
        ref_logp = forward(parts.ref)[0]  # [N, Tc]
        old_logp, entropy = forward(parts.policy if s.old_logprobs else None, s.old_statistic)  # None: the update's own
        rollout.policy_stats = torch.stack([old_logp, entropy], -1) if s.old_statistic == "sum_pi_squared" else None
        values = rollout.over_micro_batches(parts.critic.values, rows) if parts.critic is not None else None  # [N, Tc]
    if loss.kl_in_reward:
        rollout.kl_penalty = loss.kl_penalty(old_logp, ref_logp)  # [N, Tc]
    adv, returns = checked_advantages(parts.advantage, rollout, values)  # [N, Tc] each
    mask = loss.train_mask(rollout)  # [N, Tc]
    select = loss.token_selection(entropy, mask) if loss.selects_tokens else None  # [N, Tc]
    return Batch(rollout, mask, adv, returns, old_logp, ref_logp, values, select)


def logprobs(run: Run, model, rollout: Rollout, entropy: str) -> tuple:
    """`model`'s log-probs at the rollout's temperature, the policy's on replayed nuclei.  -> [n, Tc], [n, Tc] | None"""
    s = run.settings
    return rollout_logprobs(model, rollout, s.temperature, entropy, s.share_prefix, replay=model is run.parts.policy)


# ---- 3. update: epochs x mini-batches (by groups) x micro-batches; the critic on the same mini-batches ------------


def update(run: Run, batch: Batch) -> UpdateStats:
    """Every optimizer step of the step's batch. The update is skipped (`stats.skipped`, the one
    place it is set) when an advantage is not finite on any process, or at the first optimizer step
    whose loss or gradient norm is not."""
    parts, s = run.parts, run.settings
    stats = UpdateStats(skipped=parallel.any_rank(not finite(batch.adv)))
    parts.policy.train()
    with run.runtime.timer("update"):
        for rows in [] if stats.skipped else batch.rollout.mini_batches(s.epochs, s.mini_batches):
            stats.skipped = not policy_step(run, batch, rows, stats)
            if stats.skipped:
                break
            if parts.critic is not None:
                b = batch.select_rows(rows)
                stats.value_losses.append(parts.critic.fit(b.rollout, b.old_values, b.returns, b.mask))
        if stats.grad_norms:  # the warm-up counts updates, not skipped steps
            parts.schedule.step()
            parts.engine.load_weights(parts.policy)
    return stats


def policy_step(run: Run, batch: Batch, rows: torch.Tensor, stats: UpdateStats) -> bool:
    """One optimizer step on `rows`, accumulated over micro-batches. Returns whether it stepped:
    False (and no step) when the loss or the gradient norm is not finite on any process."""
    parts, s = run.parts, run.settings
    weights = parallel.global_weights(parts.aggregator, batch.mask[rows])  # [n, Tc] normalised over the mini-batch
    parts.optimizer.zero_grad(set_to_none=True)
    total, finite_loss = 0.0, True
    entropy_sums = torch.zeros(2)  # the selected tokens' entropy sum and count (adaptive coefficient)
    for micro in batch.rollout.micro_batches(rows, s.micro_batch_size, s.micro_batch_tokens):
        x, corrected = loss_input(run, batch, rows[micro])
        L, info = parts.loss(x)  # [m, Tc]
        loss = (L * weights[micro]).sum()
        finite_loss = finite(loss.detach())
        if not finite_loss:
            break
        loss.backward()
        total += float(loss.detach())
        entropy = x.entropy.detach()  # [m, Tc]
        stats.add({**info, **corrected, "entropy": entropy}, x.mask)
        counted = x.mask if x.select is None else x.mask * x.select  # [m, Tc]
        entropy_sums += torch.stack([(entropy * counted).sum(), counted.sum()]).cpu()
    if not optimizer_step(run, stats, total, finite_loss):
        return False
    parts.loss.end_step(entropy_sums)
    return True


def loss_input(run: Run, batch: Batch, idx: torch.Tensor) -> tuple[LossInput, dict]:
    """Rows `idx` of the batch as the loss takes them: the policy's forward (with gradient) and the
    correction's weights, with the correction's statistics."""
    parts, b = run.parts, batch.select_rows(idx)  # [m, Tc] each
    logp, entropy = logprobs(run, parts.policy, b.rollout, "grad" if parts.loss.entropy_grad else "metric")  # [m, Tc]
    old = logp.detach() if b.old_logp is None else b.old_logp  # [m, Tc]
    behaviour = old if b.rollout.behaviour_logp is None else b.rollout.behaviour_logp  # [m, Tc] the engine's
    is_weight, corrected = parts.correction(logp.detach(), old, behaviour, b.adv, b.mask)  # [m, Tc]
    reward = b.rollout.rewards + b.rollout.shaping  # [m]
    return LossInput(logp, old, b.adv, b.mask, b.ref_logp, entropy, is_weight, b.select, reward), corrected


def optimizer_step(run: Run, stats: UpdateStats, total: float, finite_loss: bool) -> bool:
    """Reduce the gradients over the processes, clip, and step unless this process's loss or any
    process's gradient norm is not finite (every process takes part in the reductions). Returns
    whether it stepped."""
    parts = run.parts
    run.runtime.parallel.reduce_gradients(parts.policy.parameters())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parts.policy.parameters(), run.settings.max_grad_norm))
    if parallel.any_rank(not finite_loss) or not finite(grad_norm):
        parts.optimizer.zero_grad(set_to_none=True)
        return False
    stats.losses.append(float(parallel.total(torch.tensor(total))))  # every rank's share of the loss
    stats.grad_norms.append(grad_norm)
    parts.optimizer.step()
    return True


# ---- 4. measure: the step's metrics -------------------------------------------------------------------------------


def measure(run: Run, step: int, rollout: Rollout, batch: Batch | None, stats: UpdateStats, metrics: dict) -> dict:
    parts = run.parts
    if stats.skipped:
        metrics["train/nonfinite_skipped"] = 1
        print(f"rlkit: step {step}: non-finite advantage, loss or gradient norm; update skipped", file=sys.stderr)
    if batch is None:
        metrics["train/skipped_empty_batch"] = 1
    elif rollout.num_rows:  # under data parallel, dynamic sampling may keep nothing on this rank alone
        metrics.update(kept_metrics(parts.task, list(parts.reward_fns), rollout, batch.adv))
        band = parts.correction.c_min, parts.correction.c_max  # the engine's numbers vs the trainer's
        metrics.update(mismatch_metrics(batch.old_logp, rollout.behaviour_logp, rollout.action_mask, *band))
    if batch is not None and not stats.skipped:
        weights = parallel.global_weights(parts.aggregator, batch.mask)  # [N, Tc] every rank takes part
        if rollout.num_rows:
            metrics.update(weight_metrics(rollout, batch.adv, weights))
    metrics.update(update_metrics(stats))
    if stats.value_losses:
        metrics["train/explained_variance"] = explained_variance(batch.old_values, batch.returns, batch.mask)
    metrics.update(parts.task.step_metrics())
    timer = run.runtime.timer
    metrics.update({f"time/{k}": v for k, v in timer.items()})
    metrics["perf/tokens_per_s"] = float(rollout.completion_mask.sum()) / timer["step"]
    return metrics


# ---- the loop ----------------------------------------------------------------------------------------------------


def step(run: Run, n: int) -> StepResult:
    """Step `n`: the four phases. Returns the rollout, the batch trained on (None when nothing was
    kept), the update's statistics and the step's metrics; `report` evaluates and logs them."""
    rt = run.runtime
    rt.timer.clear()
    rt.step, rt.requests = n, 0  # the keys of coupled draws
    with rt.timer("step"):
        rollout, metrics = collect(run)
        kept = parallel.any_rank(rollout.num_rows > 0)  # dynamic sampling may keep nothing
        batch, stats = prepare_and_update(run, rollout) if kept else (None, UpdateStats())
    rt.spend("steps", rt.timer["step"])
    return StepResult(rollout, batch, stats, measure(run, n, rollout, batch, stats, metrics))


def report(run: Run, n: int, done: StepResult) -> dict:
    """After step `n`: the held-out evaluation when due, the log line (the processes' mean) and
    sample completions. Returns the logged metrics."""
    s, metrics = run.settings, done.metrics
    if n == s.steps or (s.eval_every and n % s.eval_every == 0):
        run.progress.last_eval, metrics["time/eval"] = timed_eval(run)
        metrics.update(run.progress.last_eval)
    metrics = parallel.mean_metrics(metrics)
    run.runtime.logger.log(n, metrics)  # metrics without a value (None) are left out
    if s.samples_every and done.batch is not None and (n % s.samples_every == 0 or n == 1):
        run.runtime.logger.log_samples(n, samples(done.rollout, done.batch.adv, per_group=2))
    return metrics


def prepare_and_update(run: Run, rollout: Rollout) -> tuple[Batch, UpdateStats]:
    """Phases 2 and 3 on a collected rollout."""
    batch = prepare(run, rollout)
    return batch, update(run, batch)
