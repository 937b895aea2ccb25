"""`rlkit-train`: the Hydra app. One RL step is written out in `run` below (DESIGN section 3)."""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from rlkit import checkpoint
from rlkit.config import ConfigError, build, resolved, validate
from rlkit.critic import build_critic, explained_variance, token_values, value_loss
from rlkit.evaluate import evaluate
from rlkit.guards import (EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_PREEMPTED, NonFiniteError, NonFiniteGuard, Preempted,
                          StopSignals, all_finite, check_context, check_resume, check_writable, finite)
from rlkit.losses import PolicyLoss, kl_estimate
from rlkit.metrics import rollout_metrics, samples, weight_metrics
from rlkit.rewards import overlong_penalty
from rlkit.rollout import Rollout, generate, rollout_logprobs, step_reward_matrix
from rlkit.tasks.base import TaskError
from rlkit.warm_start import warm_start

hf_logging.disable_progress_bar()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Timer(dict):
    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - t0


def chunks(n: int, size: int) -> list[torch.Tensor]:
    return list(torch.arange(n).split(size if size > 0 else max(n, 1)))


@torch.no_grad()
def no_grad_pass(fn, model, r: Rollout, rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([fn(model, r.select_rows(i)) for i in rows])  # [N, Tc]


def run(cfg: DictConfig, run_dir: str, run_info: dict | None = None) -> dict:
    """Train as `cfg` says, writing to `run_dir`; `run_info` carries the chosen options (`choices`)
    and sweep name for the logger."""
    run_info = run_info or {}
    validate(cfg)  # every check that needs no model, before anything expensive
    check_writable(run_dir, "hydra.run.dir")
    if cfg.warm_start.steps:
        check_writable(cfg.warm_start.cache_dir, "warm_start.cache_dir")
    if cfg.threads or run_info.get("threads"):
        torch.set_num_threads(cfg.threads or run_info["threads"])
    R, O, LO = cfg.rollout, cfg.optim, cfg.loss
    device = torch.device(cfg.device)
    task = build(cfg, "task")
    task.check_splits()
    advantage, aggregator = build(cfg, "advantage"), build(cfg, "aggregator")
    loss_fn = PolicyLoss(**LO)
    policy, tokenizer = build(cfg, "model").build(task.alphabet, cfg.seed)
    check_context(tokenizer, policy, {"train": task.train, "eval": task.eval}, R.max_new_tokens)
    warm_start(policy, tokenizer, task, cfg.warm_start, {"model": resolved(cfg.model), "task": resolved(cfg.task)})
    policy.to(device)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if LO.beta > 0 else None
    critic = build_critic(policy) if advantage.needs_critic else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=O.lr, weight_decay=O.weight_decay, betas=(O.beta1, O.beta2))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (O.warmup_steps + 1)))
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=advantage.critic_lr) if critic is not None else None
    sampler = build(cfg, "sampler", dataset=task.train, batch_size=R.prompts_per_step, seed=cfg.seed)
    seed_everything(cfg.seed)

    start, state = 0, {}
    last = checkpoint.latest(run_dir) if cfg.checkpoint.resume else None
    if last is not None:  # resume: weights, optimizers, sampler position, RNG, step
        state = checkpoint.load_state(last)
        check_resume(state.get("config"), resolved(cfg), last)
        policy.load_state_dict(type(policy).from_pretrained(last / "policy").state_dict())
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        if critic is not None:
            critic.load_state_dict(type(critic).from_pretrained(last / "critic").state_dict())
            critic_opt.load_state_dict(state["critic_optimizer"])
        sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        start = state["step"]
        print(f"rlkit: resuming from {last} (step {start})", file=sys.stderr)
    logger = build(cfg, "logger", run_dir=run_dir, run_config=resolved(cfg), resume_step=start,
                   run_id=state.get("run_id"), run_info=run_info)
    Path(run_dir, "run.json").write_text(json.dumps({"choices": run_info.get("choices", {}), "config": resolved(cfg)},
                                                    indent=1))
    eval_kw = dict(batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens or R.max_new_tokens)
    first_eval = state.get("first_eval") or evaluate(policy, tokenizer, task, **eval_kw)
    last_eval = state.get("last_eval", first_eval)
    if start == 0:
        logger.log(0, first_eval)
    G, single_update = R.group_size, O.epochs == 1 and O.mini_batches == 1
    kl_in_reward = ref is not None and LO.kl_placement == "reward"
    timer, guard = Timer(), NonFiniteGuard(O.max_nonfinite)
    logp_fn = lambda model, r: rollout_logprobs(model, r, R.temperature)[0]  # noqa: E731
    entropy_mode = "grad" if LO.entropy_coef else "metric"

    def make_rollout(rows: list[dict]) -> Rollout:
        rows = [row for row in rows for _ in range(G)]  # N rows, each group contiguous
        with timer("generate"):
            pid, pmask, cid, cmask, truncated = generate(policy, tokenizer, [r["prompt"] for r in rows],
                                                         R.max_new_tokens, R.temperature, R.top_p)
        with timer("score"):
            texts = tokenizer.batch_decode(cid, skip_special_tokens=True)
            r = Rollout(pid, pmask, cid, cmask, truncated, G, rows, texts, task.score(rows, texts).to(device))
            if cfg.reward.overlong_cache:
                r.shaping = overlong_penalty(r.lengths, R.max_new_tokens, cfg.reward.overlong_cache)  # [N]
            if getattr(advantage, "needs_step_rewards", False):
                r.step_rewards, r.step_mask = step_reward_matrix(task.score_steps(rows, texts), cid, cmask, tokenizer)
        return r

    def save_checkpoint(step: int) -> Path:
        if not all_finite(policy):  # never write a non-finite state over a good checkpoint
            raise NonFiniteError(f"the policy has non-finite weights at step {step}; checkpoint not written")
        models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
        extra = {"critic_optimizer": critic_opt.state_dict()} if critic is not None else {}
        return checkpoint.save(run_dir, step, models, tokenizer,
                               {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), **extra,
                                "sampler": sampler.state_dict(), "first_eval": first_eval, "last_eval": last_eval,
                                "run_id": logger.run_id, "config": resolved(cfg)}, keep=cfg.checkpoint.keep)

    t_start = time.perf_counter()
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc="rlkit", file=sys.stderr)
    with StopSignals() as stop:  # SIGTERM/SIGINT: finish the step, checkpoint, exit
        for step in bar:
            timer.clear()
            with timer("step"):
                # 1. rollout: P prompts, G completions each, scored (the sampler may generate more)
                policy.eval()
                rollout, metrics = sampler.sample(make_rollout)
                N = rollout.completion_ids.shape[0]
                mask = rollout.completion_mask.float()  # [N, Tc]
                rows_all = chunks(N, O.micro_batch_size)
                # 2. forwards needed before the update: reference (beta > 0), old log-probs (reused
                #    rollout or KL in the reward), critic values
                with timer("logprob"):
                    ref_logp = no_grad_pass(logp_fn, ref, rollout, rows_all) if ref is not None and N else None
                    reuse_old = N and (not single_update or kl_in_reward)
                    old_logp = no_grad_pass(logp_fn, policy, rollout, rows_all) if reuse_old else None
                    old_values = no_grad_pass(token_values, critic, rollout, rows_all) if critic is not None and N else None
                # 3. advantages (KL placed in the reward first, if so configured)
                if kl_in_reward and N:
                    rollout.kl_penalty = LO.beta * kl_estimate(old_logp, ref_logp, LO.kl_estimator)  # [N, Tc]
                if critic is not None and N:
                    adv, returns = advantage.advantages_and_returns(rollout, old_values)  # [N, Tc] each
                else:
                    adv = advantage(rollout) if N else mask  # [N, Tc]
                # 4. policy update: epochs x mini-batches, gradient accumulation over micro-batches;
                #    a NaN or inf advantage, loss or gradient norm skips the update
                policy.train()
                stats = dict.fromkeys(("clip_frac_low", "clip_frac_high", "kl", "entropy", "ratio_dev", "tokens"), 0.0)
                losses, grad_norms, value_losses = [], [], []
                skipped = not finite(adv)
                with timer("update"):
                    for _ in range(O.epochs if N and not skipped else 0):
                        groups = torch.randperm(rollout.num_groups) if O.mini_batches > 1 else torch.arange(rollout.num_groups)
                        for mb in groups.chunk(O.mini_batches):
                            mb_rows = rollout.group_rows(mb)  # [n]
                            weights = aggregator.token_weights(mask[mb_rows])  # [n, Tc] normalised over the mini-batch
                            optimizer.zero_grad(set_to_none=True)
                            total = 0.0
                            for micro in chunks(len(mb_rows), O.micro_batch_size):
                                idx = mb_rows[micro]  # [m]
                                logp, entropy = rollout_logprobs(policy, rollout.select_rows(idx), R.temperature, entropy_mode)
                                old = logp.detach() if old_logp is None else old_logp[idx]  # [m, Tc]
                                ref_i = ref_logp[idx] if ref_logp is not None else None
                                L, info = loss_fn(logp, old, adv[idx], ref_i, entropy)  # [m, Tc]
                                loss = (L * weights[micro]).sum()
                                if not finite(loss.detach()):
                                    skipped = True
                                    break
                                loss.backward()
                                total += float(loss.detach())
                                m = mask[idx]
                                for k, v in (("clip_frac_low", info["clip_low"]), ("clip_frac_high", info["clip_high"]),
                                             ("ratio_dev", (info["ratio"] - 1).abs()), ("entropy", entropy.detach()),
                                             ("kl", info.get("kl", torch.zeros_like(m)))):
                                    stats[k] += float((v * m).sum())
                                stats["tokens"] += float(m.sum())
                            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), O.max_grad_norm))
                            if skipped or not finite(grad_norm):
                                skipped = True
                                optimizer.zero_grad(set_to_none=True)
                                break
                            losses.append(total)
                            grad_norms.append(grad_norm)
                            optimizer.step()
                            if critic is not None:  # 5. critic update on the same mini-batch
                                critic_opt.zero_grad(set_to_none=True)
                                values = token_values(critic, rollout.select_rows(mb_rows))  # [n, Tc]
                                vl = value_loss(values, old_values[mb_rows], returns[mb_rows], advantage.value_clip)
                                vl = (vl * mask[mb_rows]).sum() / mask[mb_rows].sum().clamp(min=1)
                                vl.backward()
                                torch.nn.utils.clip_grad_norm_(critic.parameters(), O.max_grad_norm)
                                critic_opt.step()
                                value_losses.append(float(vl.detach()))
                        if skipped:
                            break
                    if grad_norms:  # the warm-up counts updates, not skipped steps
                        schedule.step()
            tokens = max(stats.pop("tokens"), 1.0)
            if skipped:
                metrics["train/nonfinite_skipped"] = 1
                print(f"rlkit: step {step}: non-finite advantage, loss or gradient norm; update skipped", file=sys.stderr)
            if not N:
                metrics["train/skipped_empty_batch"] = 1
            else:
                metrics.update(rollout_metrics(rollout, adv))
            if N and not skipped:
                metrics.update(weight_metrics(rollout, adv, aggregator.token_weights(mask)))
                metrics.update({f"train/{k}": v / tokens for k, v in stats.items()})
                metrics.update({"train/loss": sum(losses) / len(losses), "train/grad_norm": sum(grad_norms) / len(grad_norms)})
            if ref is None:
                metrics.pop("train/kl", None)
            if critic is not None and value_losses:
                metrics.update({"train/value_loss": sum(value_losses) / len(value_losses),
                                "train/explained_variance": explained_variance(old_values, returns, mask)})
            metrics.update({f"time/{k}": v for k, v in timer.items()})
            metrics["perf/tokens_per_s"] = float(mask.sum()) / timer["step"]
            if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                last_eval = evaluate(policy, tokenizer, task, **eval_kw)
                metrics.update(last_eval)
            logger.log(step, metrics)
            if cfg.samples_every and N and (step % cfg.samples_every == 0 or step == 1):
                logger.log_samples(step, samples(rollout, adv, per_group=2))
            bar.set_postfix(reward=f"{metrics.get('train/reward', 0.0):.2f}", acc=f"{last_eval['eval/accuracy']:.2f}")
            if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or stop.received:
                path = save_checkpoint(step)
            if stop.received:
                logger.finish()
                raise Preempted(f"stopped by {stop.received} after step {step}; checkpoint {path}; "
                                "rerun the same command (same hydra.run.dir) to resume")
            guard.record(skipped, step)
    logger.finish()
    summary = {"accuracy_before": first_eval["eval/accuracy"], "accuracy_after": last_eval["eval/accuracy"],
               "steps": cfg.steps, "wall_s": round(time.perf_counter() - t_start, 1)}
    Path(run_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"rlkit: held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} "
          f"in {summary['wall_s']:.0f}s over {cfg.steps} steps ({run_dir})", file=sys.stderr)
    return summary


def hydra_run_info() -> dict:
    """Chosen options, and in a sweep its name, this run's overrides and threads per parallel job."""
    hc = HydraConfig.get()
    info = {"choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}}
    if hc.mode == RunMode.MULTIRUN:
        info.update(sweep=Path(hc.sweep.dir).name, name=hc.job.override_dirname or None)
        jobs = OmegaConf.select(hc, "launcher.n_jobs")
        if jobs is not None:  # parallel jobs share the cores
            cores = os.cpu_count() or 1
            info["threads"] = max(1, cores // (cores if jobs < 1 else min(jobs, cores)))
    return info


def config_path() -> str:
    """The installed configs (`rlkit.conf`), or the checkout's `conf/` when `rlkit` is imported
    from a source tree that was not installed (for example `python -m rlkit.train` from the repo root
    next to a non-editable install)."""
    if importlib.util.find_spec("rlkit.conf") is not None:
        return "pkg://rlkit.conf"
    return str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base=None, config_path=config_path(), config_name="config")
def main(cfg: DictConfig) -> dict | None:
    try:
        return run(cfg, HydraConfig.get().runtime.output_dir, hydra_run_info())
    except (ConfigError, TaskError) as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except NonFiniteError as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        sys.exit(EXIT_NON_FINITE)
    except Preempted as e:
        print(f"rlkit: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    main()
