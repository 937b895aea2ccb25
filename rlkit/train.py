"""`rlkit-train`: the Hydra app. One RL step is written out in `run` below (DESIGN section 3)."""
from __future__ import annotations

import copy
import json
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from rlkit import checkpoint
from rlkit.config import ConfigError, build, resolved, validate
from rlkit.evaluate import evaluate
from rlkit.losses import PolicyLoss
from rlkit.metrics import rollout_metrics
from rlkit.rollout import Rollout, generate, rollout_logprobs
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
def logprobs_no_grad(model, r: Rollout, rows: list[torch.Tensor], temperature: float) -> torch.Tensor:
    return torch.cat([rollout_logprobs(model, r.select_rows(i), temperature)[0] for i in rows])  # [N, Tc]


def run(cfg: DictConfig, run_dir: str) -> dict:
    validate(cfg)  # every check that needs no model, before anything expensive
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    R, O = cfg.rollout, cfg.optim
    device = torch.device(cfg.device)
    task = build(cfg, "task")
    task.check_splits()
    advantage, aggregator = build(cfg, "advantage"), build(cfg, "aggregator")
    loss_fn = PolicyLoss(**cfg.loss)
    policy, tokenizer = build(cfg, "model").build(task.alphabet, cfg.seed)
    warm_start(policy, tokenizer, task, cfg.warm_start, {"model": resolved(cfg.model), "task": resolved(cfg.task)})
    policy.to(device)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if cfg.loss.beta > 0 else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=O.lr, weight_decay=O.weight_decay, betas=(O.beta1, O.beta2))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (O.warmup_steps + 1)))
    sampler = build(cfg, "sampler", dataset=task.train, batch_size=R.prompts_per_step, seed=cfg.seed)
    seed_everything(cfg.seed)

    start, state = 0, {}
    last = checkpoint.latest(run_dir) if cfg.checkpoint.resume else None
    if last is not None:  # resume: weights, optimizer, sampler position, RNG, step
        state = checkpoint.load_state(last)
        policy.load_state_dict(type(policy).from_pretrained(last / "policy").state_dict())
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        start = state["step"]
        print(f"rlkit: resuming from {last} (step {start})", file=sys.stderr)
    logger = build(cfg, "logger", run_dir=run_dir, run_config=resolved(cfg), resume_step=start, run_id=state.get("run_id"))
    eval_kw = dict(batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens or R.max_new_tokens)
    first_eval = state.get("first_eval") or evaluate(policy, tokenizer, task, **eval_kw)
    last_eval = state.get("last_eval", first_eval)
    if start == 0:
        logger.log(0, first_eval)
    G, single_update = R.group_size, O.epochs == 1 and O.mini_batches == 1
    timer = Timer()

    def make_rollout(rows: list[dict]) -> Rollout:
        rows = [row for row in rows for _ in range(G)]  # N rows, each group contiguous
        with timer("generate"):
            pid, pmask, cid, cmask, truncated = generate(policy, tokenizer, [r["prompt"] for r in rows],
                                                         R.max_new_tokens, R.temperature, R.top_p)
        with timer("score"):
            texts = tokenizer.batch_decode(cid, skip_special_tokens=True)
            rewards = task.score(rows, texts).to(device)  # [N]
        return Rollout(pid, pmask, cid, cmask, truncated, G, rows, texts, rewards)

    t_start = time.perf_counter()
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc="rlkit", file=sys.stderr)
    for step in bar:
        timer.clear()
        with timer("step"):
            # 1. rollout: P prompts, G completions each, scored
            policy.eval()
            rollout, metrics = sampler.sample(make_rollout)
            N = rollout.completion_ids.shape[0]
            mask = rollout.completion_mask.float()  # [N, Tc]
            rows_all = chunks(N, O.micro_batch_size)
            # 2. log-probs needed before the update: reference (beta > 0), old (only if reused)
            with timer("logprob"):
                ref_logp = logprobs_no_grad(ref, rollout, rows_all, R.temperature) if ref is not None else None
                old_logp = None if single_update else logprobs_no_grad(policy, rollout, rows_all, R.temperature)
            # 3. advantages
            adv = advantage(rollout)  # [N, Tc]
            # 4. policy update: epochs x mini-batches, gradient accumulation over micro-batches
            policy.train()
            stats = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "kl": 0.0, "entropy": 0.0, "ratio_dev": 0.0, "loss": 0.0, "tokens": 0.0}
            grad_norms = []
            with timer("update"):
                for _ in range(O.epochs):
                    groups = torch.randperm(rollout.num_groups) if O.mini_batches > 1 else torch.arange(rollout.num_groups)
                    for mb in groups.chunk(O.mini_batches):
                        mb_rows = (mb[:, None] * G + torch.arange(G)).reshape(-1)  # [n]
                        weights = aggregator.token_weights(mask[mb_rows])  # [n, Tc] normalised over the mini-batch
                        optimizer.zero_grad(set_to_none=True)
                        for micro in chunks(len(mb_rows), O.micro_batch_size):
                            idx = mb_rows[micro]  # [m]
                            logp, entropy = rollout_logprobs(policy, rollout.select_rows(idx), R.temperature, True)
                            old = logp.detach() if single_update else old_logp[idx]  # [m, Tc]
                            ref_i = ref_logp[idx] if ref_logp is not None else None
                            L, info = loss_fn(logp, old, adv[idx], ref_i, entropy)  # [m, Tc]
                            loss = (L * weights[micro]).sum()
                            loss.backward()
                            m = mask[idx]
                            stats["loss"] += float(loss.detach())
                            stats["tokens"] += float(m.sum())
                            stats["clip_frac_low"] += float((info["clip_low"] * m).sum())
                            stats["clip_frac_high"] += float((info["clip_high"] * m).sum())
                            stats["ratio_dev"] += float(((info["ratio"] - 1).abs() * m).sum())
                            stats["entropy"] += float((entropy.detach() * m).sum())
                            if "kl" in info:
                                stats["kl"] += float((info["kl"] * m).sum())
                        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), O.max_grad_norm)))
                        optimizer.step()
                schedule.step()
        tokens = max(stats.pop("tokens"), 1.0)
        n_updates = O.epochs * O.mini_batches
        metrics.update(rollout_metrics(rollout, adv))
        metrics.update({f"train/{k}": v / tokens for k, v in stats.items() if k != "loss"})
        metrics.update({"train/loss": stats["loss"] / n_updates, "train/grad_norm": sum(grad_norms) / len(grad_norms),
                        **{f"time/{k}": v for k, v in timer.items()},
                        "perf/tokens_per_s": float(mask.sum()) / timer["step"]})
        if ref is None:
            metrics.pop("train/kl")
        if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            last_eval = evaluate(policy, tokenizer, task, **eval_kw)
            metrics.update(last_eval)
        logger.log(step, metrics)
        bar.set_postfix(reward=f"{metrics['train/reward']:.2f}", acc=f"{last_eval['eval/accuracy']:.2f}")
        if step == cfg.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            checkpoint.save(run_dir, step, {"policy": policy}, tokenizer,
                            {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "sampler": sampler.state_dict(),
                             "first_eval": first_eval, "last_eval": last_eval, "run_id": logger.run_id}, keep=cfg.checkpoint.keep)
    logger.finish()
    summary = {"accuracy_before": first_eval["eval/accuracy"], "accuracy_after": last_eval["eval/accuracy"],
               "steps": cfg.steps, "wall_s": round(time.perf_counter() - t_start, 1)}
    Path(run_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"rlkit: held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} "
          f"in {summary['wall_s']:.0f}s over {cfg.steps} steps ({run_dir})", file=sys.stderr)
    return summary


@hydra.main(version_base=None, config_path="pkg://rlkit.conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    try:
        return run(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, TaskError) as e:
        print(f"rlkit: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
