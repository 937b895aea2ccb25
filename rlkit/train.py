"""`rlkit-train`: the Hydra app. The RL loop in `run` calls four phases, written out below in the
order they run: `collect` (sample prompts, generate, score), `prepare`
(reference and old log-probs, critic values, KL in the reward, advantages), `update` (epochs x
mini-batches x micro-batches) and `log` (metrics, evaluation, samples). `setup` builds the run."""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from rlkit import distributed, files
from rlkit.config import ConfigError, validate
from rlkit.critic import explained_variance
from rlkit.evaluate import evaluate
from rlkit.guards import (EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_PREEMPTED, EXIT_STORAGE, NonFiniteError, Preempted, RunDirLock,
                          StoppedAtOnce, StopSignals, checked_advantages, check_writable, finite)
from rlkit.hardware import PORTABLE_ENV, check_portable
from rlkit.logprobs import rollout_logprobs
from rlkit.metrics import mean_or_none, reward_metrics, rollout_metrics, samples, weight_metrics
from rlkit.rewards import overlong_penalty, score, step_reward_matrix
from rlkit.setup import ComposeCheck, RunState, config_path, discard_refused, hydra_run_info, save_checkpoint, setup
from rlkit.tasks.base import TaskError
from rlkit.types import Rollout

hf_logging.disable_progress_bar()
PEER_GRACE_S = 5.0


class Timer(dict):
    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - t0


def micro_batches(r: Rollout, rows: torch.Tensor, max_rows: int, max_tokens: int) -> list[torch.Tensor]:
    """`rows` of `r` in micro-batches of similar length, so that trimming each to its own longest
    row (`trimmed_inputs`) leaves little padding: sorted by prompt + completion length and cut
    before a micro-batch passes `max_rows` rows or `max_tokens` padded tokens (0: no limit).
    Returns positions in `rows`.  -> [m] each"""
    if not max_rows and not max_tokens:  # one micro-batch, in the same (stable, by length) order
        lengths = r.prompt_mask[rows].sum(-1) + r.completion_mask[rows].sum(-1)  # [n]
        return [torch.argsort(lengths, stable=True).cpu()] if len(rows) else []
    plen, clen = r.prompt_mask[rows].sum(-1).tolist(), r.completion_mask[rows].sum(-1).tolist()  # [n] each
    out, cur, width = [], [], (0, 0)
    for i in sorted(range(len(plen)), key=lambda i: plen[i] + clen[i]):
        grown = (max(width[0], plen[i]), max(width[1], clen[i]))
        if cur and (len(cur) == max_rows or max_tokens and (len(cur) + 1) * sum(grown) > max_tokens):
            out.append(torch.tensor(cur))
            cur, grown = [], (plen[i], clen[i])
        cur.append(i)
        width = grown
    return out + [torch.tensor(cur)] if cur else out


@torch.no_grad()
def batched(fn, r: Rollout, micro: list[torch.Tensor]) -> torch.Tensor:
    """fn over the micro-batches of rows `micro`, put back in row order.  -> [N, Tc]"""
    out = torch.zeros(r.completion_ids.shape, device=r.completion_ids.device)  # [N, Tc]
    for rows in micro:
        out[rows] = fn(r.select_rows(rows))
    return out


@dataclass
class Batch:
    """A scored rollout with everything the update needs, all [N, Tc]."""

    rollout: Rollout
    mask: torch.Tensor                # the loss's training mask
    adv: torch.Tensor
    returns: torch.Tensor | None      # critic targets, when the estimator has them
    old_logp: torch.Tensor | None     # None: the update's own log-probs, detached (one update per rollout)
    ref_logp: torch.Tensor | None     # None: no reference (beta = 0)
    old_values: torch.Tensor | None   # None: no critic


@dataclass
class UpdateStats:
    skipped: bool = False                              # a NaN or inf advantage, loss or gradient norm
    sums: dict = field(default_factory=dict)           # loss statistics summed over tokens
    tokens: float = 0.0
    losses: list = field(default_factory=list)         # one per optimizer step
    grad_norms: list = field(default_factory=list)
    value_losses: list = field(default_factory=list)


# ---- 1. collect: P prompts from the sampler, G completions each from the engine, scored -------------------------

def collect(run: RunState) -> tuple[Rollout, dict]:
    run.policy.eval()
    generated = []  # every rollout the sampler asked for, kept or not

    def make(rows: list[dict]) -> Rollout:
        generated.append(make_rollout(run, rows))
        return generated[-1]

    rollout, metrics = run.sampler.sample(make)
    every = torch.cat([r.rewards for r in generated])  # [N_generated] kept or not
    return rollout, {**metrics, "train/gen_tokens": sum(int(r.completion_mask.sum()) for r in generated),
                     "train/reward_all": mean_or_none(every)}


def make_rollout(run: RunState, rows: list[dict]) -> Rollout:
    R, G = run.cfg.rollout, run.cfg.rollout.group_size
    rows = [row for row in distributed.shard(rows, run.rank, run.world) for _ in range(G)]  # N rows, groups contiguous
    with run.timer("generate"):
        gen = run.engine.generate([r["prompt"] for r in rows], R.max_new_tokens, R.temperature, R.top_p)
    with run.timer("score"):
        texts = run.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        rewards, parts = score(run.task, run.reward_fns, run.cfg.reward.combine, rows, texts, G,
                               run.cfg.reward.timeout_s)  # [N], [N, K]
        r = Rollout(*gen, G, rows, texts, rewards.to(run.device), reward_parts=parts)
        if run.cfg.reward.overlong_cache:
            r.shaping = overlong_penalty(r.lengths, R.max_new_tokens, run.cfg.reward.overlong_cache)  # [N]
        if run.advantage.needs_step_rewards:
            r.step_rewards, r.step_mask = step_reward_matrix(run.task.score_steps(rows, texts, run.cfg.reward.timeout_s),
                                                             gen.completion_ids,
                                                             gen.completion_mask, run.tokenizer)
    return r


# ---- 2. prepare: forwards needed before the update, then advantages ----------------------------------------------

def prepare(run: RunState, rollout: Rollout) -> Batch:
    O, loss = run.cfg.optim, run.loss
    rows = micro_batches(rollout, torch.arange(rollout.num_rows), O.micro_batch_size, O.micro_batch_tokens)
    logp = lambda model: lambda r: rollout_logprobs(model, r, run.cfg.rollout.temperature)[0]  # noqa: E731
    # old log-probs come free from the update itself unless the rollout is reused, the KL sits in the
    # reward, or the engine's numbers are not the trainer's
    reuse = O.epochs == 1 and O.mini_batches == 1 and not loss.kl_in_reward and run.engine.exact_logprobs
    with run.timer("logprob"):
        ref_logp = batched(logp(run.ref), rollout, rows) if run.ref is not None else None  # [N, Tc]
        old_logp = None if reuse else batched(logp(run.policy), rollout, rows)  # [N, Tc]
        old_values = batched(run.critic.values, rollout, rows) if run.critic is not None else None  # [N, Tc]
    if loss.kl_in_reward:
        rollout.kl_penalty = loss.kl_penalty(old_logp, ref_logp)  # [N, Tc]
    adv, returns = checked_advantages(run.advantage, rollout, old_values)  # [N, Tc] each
    return Batch(rollout, loss.train_mask(rollout), adv, returns, old_logp, ref_logp, old_values)


# ---- 3. update: epochs x mini-batches (by groups) x micro-batches; the critic on the same mini-batches ------------

def update(run: RunState, batch: Batch) -> UpdateStats:
    O, stats = run.cfg.optim, UpdateStats(skipped=distributed.any_rank(not finite(batch.adv)))
    run.policy.train()
    with run.timer("update"):
        for rows in ([] if stats.skipped else mini_batches(batch.rollout, O.epochs, O.mini_batches)):
            if not policy_step(run, batch, rows, stats):
                break
            if run.critic is not None:
                stats.value_losses.append(run.critic.update(batch.rollout.select_rows(rows), batch.old_values[rows],
                                                            batch.returns[rows], batch.mask[rows]))
        if stats.grad_norms:  # the warm-up counts updates, not skipped steps
            run.schedule.step()
            run.engine.load_weights(run.policy)
    return stats


def mini_batches(rollout: Rollout, epochs: int, n: int):
    """Row indices of each mini-batch, whole groups, reshuffled every epoch when n > 1.  -> [n_rows] each"""
    for _ in range(epochs):
        groups = torch.randperm(rollout.num_groups) if n > 1 else torch.arange(rollout.num_groups)
        yield from (rollout.group_rows(mb) for mb in groups.chunk(n))


def policy_step(run: RunState, batch: Batch, rows: torch.Tensor, stats: UpdateStats) -> bool:
    """One optimizer step on `rows`, accumulated over micro-batches; False (and no step) when the
    loss or the gradient norm is not finite."""
    O, loss_fn = run.cfg.optim, run.loss
    weights = distributed.global_weights(run.aggregator, batch.mask[rows])  # [n, Tc] normalised over the mini-batch
    run.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for micro in micro_batches(batch.rollout, rows, O.micro_batch_size, O.micro_batch_tokens):
        idx = rows[micro]  # [m]
        r, m = batch.rollout.select_rows(idx), batch.mask[idx]  # m: [m, Tc]
        logp, entropy = rollout_logprobs(run.policy, r, run.cfg.rollout.temperature,
                                         "grad" if loss_fn.entropy_grad else "metric")  # [m, Tc] each
        old = logp.detach() if batch.old_logp is None else batch.old_logp[idx]  # [m, Tc]
        ref = batch.ref_logp[idx] if batch.ref_logp is not None else None
        L, info = loss_fn(logp, old, batch.adv[idx], m, ref, entropy)  # [m, Tc]
        loss = (L * weights[micro]).sum()
        if not finite(loss.detach()):
            stats.skipped = True
            break
        loss.backward()
        total += float(loss.detach())
        for k, v in {**info, "entropy": entropy.detach()}.items():
            stats.sums[k] = stats.sums.get(k, 0.0) + float((v * m).sum())
        stats.tokens += float(m.sum())
    distributed.sum_gradients(run.policy.parameters())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.policy.parameters(), O.max_grad_norm))
    if distributed.any_rank(stats.skipped) or not finite(grad_norm):
        stats.skipped = True
        run.optimizer.zero_grad(set_to_none=True)
        return False
    stats.losses.append(float(distributed.total(torch.tensor(total))))  # every rank's share of the loss
    stats.grad_norms.append(grad_norm)
    run.optimizer.step()
    return True


# ---- 4. log: step metrics, held-out evaluation, sample completions ------------------------------------------------

def log(run: RunState, step: int, rollout: Rollout, batch: Batch | None, stats: UpdateStats, metrics: dict) -> dict:
    if stats.skipped:
        metrics["train/nonfinite_skipped"] = 1
        print(f"rlkit: step {step}: non-finite advantage, loss or gradient norm; update skipped", file=sys.stderr)
    if batch is None:
        metrics["train/skipped_empty_batch"] = 1
    elif rollout.num_rows:  # under data parallel, dynamic sampling may keep nothing on this rank alone
        metrics.update(rollout_metrics(rollout, batch.adv))
        metrics.update(reward_metrics(rollout, list(run.reward_fns)))
    if batch is not None and not stats.skipped:
        weights = distributed.global_weights(run.aggregator, batch.mask)  # [N, Tc] every rank takes part
        if rollout.num_rows:
            metrics.update(weight_metrics(rollout, batch.adv, weights))
        metrics.update({f"train/{k}": v / max(stats.tokens, 1.0) for k, v in stats.sums.items()})
        metrics.update({"train/loss": sum(stats.losses) / len(stats.losses),
                        "train/grad_norm": sum(stats.grad_norms) / len(stats.grad_norms)})
    if stats.value_losses:
        metrics.update({"train/value_loss": sum(stats.value_losses) / len(stats.value_losses),
                        "train/explained_variance": explained_variance(batch.old_values, batch.returns, batch.mask)})
    metrics.update(run.task.step_metrics())
    metrics.update({f"time/{k}": v for k, v in run.timer.items()})
    metrics["perf/tokens_per_s"] = float(rollout.completion_mask.sum()) / run.timer["step"]
    cfg = run.cfg
    if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
        run.last_eval = evaluate(run.engine, run.tokenizer, run.task, **run.eval_kw)
        metrics.update(run.last_eval)
    metrics = distributed.mean_metrics(metrics)
    run.logger.log(step, metrics)  # metrics without a value (None) are left out
    if cfg.samples_every and batch is not None and (step % cfg.samples_every == 0 or step == 1):
        run.logger.log_samples(step, samples(rollout, batch.adv, per_group=2))
    return metrics


def run(cfg: DictConfig, run_dir: str, run_info: dict | None = None) -> dict:
    """Train as `cfg` says, writing to `run_dir`; `run_info` carries the chosen options (`choices`)
    and sweep name for the logger."""
    t0 = time.perf_counter()
    rank, world = distributed.init(cfg.device)
    agreed = False  # whether every rank ends here the same way (finished, or stopped after the same step)
    try:
        summary = train(cfg, run_dir, run_info, rank, world, t0)
        agreed = True
        return summary
    except (Preempted, NonFiniteError):  # decided on every rank after the same step
        agreed = True
        raise
    finally:
        distributed.close(agreed)


def train(cfg: DictConfig, run_dir: str, run_info: dict | None, rank: int, world: int, t0: float) -> dict:
    validate(cfg, world)  # every check that needs no model, before anything is built or written
    check_portable(cfg.portable)
    check_writable(run_dir, "hydra.run.dir")
    with RunDirLock(run_dir) if rank == 0 else nullcontext(), StopSignals() as stop:  # SIGTERM/SIGINT: finish the step
        state = setup(cfg, run_dir, run_info or {}, stop, rank, world)
        state.timer, state.t0 = Timer(), t0
        if stop.received:
            raise Preempted(f"stopped by {stop.received} before the first step; rerun the same command to start")
        bar = tqdm(range(state.start + 1, cfg.steps + 1), initial=state.start, total=cfg.steps, desc="rlkit",
                   file=sys.stderr)
        for step in bar:
            state.timer.clear()
            with state.timer("step"):
                rollout, metrics = collect(state)
                kept = distributed.any_rank(rollout.num_rows > 0)  # dynamic sampling may keep nothing
                batch = prepare(state, rollout) if kept else None
                stats = update(state, batch) if batch is not None else UpdateStats()
            metrics = log(state, step, rollout, batch, stats, metrics)
            bar.set_postfix(reward=f"{metrics.get('train/reward', 0.0):.2f}", acc=f"{state.last_eval['eval/accuracy']:.2f}")
            stopping = distributed.any_rank(bool(stop.received))  # every rank stops after the same step
            if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or stopping:
                path = save_checkpoint(state, step)
            if stopping:
                state.logger.finish()
                raise Preempted(f"stopped by {stop.received or 'a signal to another rank'} after step {step}; "
                                f"checkpoint {path}; rerun the same command (same hydra.run.dir) to resume")
            state.guard.record(stats.skipped, step)
        state.logger.finish()
        return write_summary(state)


def write_summary(state: RunState) -> dict:
    """summary.json and the closing line; wall time counts every session of the run, set-up included.
    A rerun of a finished run keeps its summary."""
    path = Path(state.run_dir, "summary.json")
    if state.rank:
        return {}
    if state.finished_before and path.exists():
        print(f"rlkit: the run in {state.run_dir} had already finished at step {state.start}; nothing to do",
              file=sys.stderr)
        return json.loads(path.read_text())
    summary = {"accuracy_before": state.first_eval["eval/accuracy"], "accuracy_after": state.last_eval["eval/accuracy"],
               "steps": state.cfg.steps, "wall_s": round(state.wall_s(), 1)}
    files.write_text(path, json.dumps(summary, indent=1))
    print(f"rlkit: held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} "
          f"in {summary['wall_s']:.0f}s over {state.cfg.steps} steps ({state.run_dir})", file=sys.stderr)
    return summary


@hydra.main(version_base=None, config_path=config_path(), config_name="config")
def app(cfg: DictConfig) -> dict | None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        return run(cfg, run_dir, hydra_run_info())
    except (ConfigError, TaskError) as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        discard_refused(run_dir)
        sys.exit(EXIT_BAD_INPUT)
    except NonFiniteError as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        sys.exit(EXIT_NON_FINITE)
    except (Preempted, StoppedAtOnce) as e:
        print(f"rlkit: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except files.StorageError as e:
        print(f"rlkit: error: {e}; earlier checkpoints are intact: free space and rerun the same command to "
              "resume", file=sys.stderr)
        sys.exit(EXIT_STORAGE)
    except Exception as e:
        if not distributed.peer_failed(e):
            raise
        print(f"rlkit: error: another process of this run failed (its message is above); stopping this one "
              f"({type(e).__name__})", file=sys.stderr)
        time.sleep(PEER_GRACE_S)  # let the failing process exit first, so the launcher reports its own code
        sys.exit(1)


def main() -> None:
    """`rlkit-train`. Like `python -m`, puts the current directory on the import path, so a plugin
    module next to the user's configs imports. A config that does not compose exits 2, as other
    bad input does (Hydra's own message says why). `portable=true` pins torch's CPU kernels before
    any of them runs."""
    if any(a.lstrip("+").lower() == "portable=true" for a in sys.argv[1:]):
        for key, value in PORTABLE_ENV.items():  # read when torch, MKL and oneDNN first run a kernel
            os.environ.setdefault(key, value)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    launched = distributed.launch_time()
    if launched is not None:  # every rank resolves ${now:...} (the default run directory) to the same folder
        OmegaConf.register_new_resolver("now", launched.strftime, use_cache=True, replace=True)
    try:
        app()
    except SystemExit as e:
        if e.code == 1 and not ComposeCheck.composed:
            print("rlkit: error: the overrides or config files above did not compose. A component's own options "
                  "are listed by adding the key with '+' (e.g. +advantage.bogus=1); `rlkit-train --help` lists the "
                  "groups and their options", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        raise


if __name__ == "__main__":
    main()
