"""Supervised warm start on the task's demonstrations, so RL starts from a policy with partial
accuracy. It is shared by every RL seed: the model is initialised from `warm_start.seed` (not the
run's seed), the result is cached on disk under a hash of everything that shapes it (model, task,
warm-start settings, that seed), and a file lock makes jobs that start together on an empty cache
train it once and all load the same weights."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

import torch

from rlkit import atomic, progress
from rlkit.atomic import file_lock, staged
from rlkit.hardware import kernels
from rlkit.logprobs import demonstration_batch, token_logprobs
from rlkit.signals import Preempted


def applies(cfg, task) -> bool:
    """Whether the run warm-starts: steps > 0 and the task has demonstrations."""
    return cfg.steps > 0 and task.demonstration is not None


def cache_path(cache_dir: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(os.path.expanduser(cache_dir)) / digest


def train_supervised(policy, tokenizer, task, steps: int, batch_size: int, lr: float, seed: int, stop=None) -> None:
    """`stop.received` (a signal name) aborts between steps with `Preempted`; nothing is cached."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    policy.train()
    pool = task.train if task.demonstrations is None else task.demonstrations  # the prompts demonstrated
    n = len(pool)
    for _ in progress.steps(range(steps), "rlkit: warm start, steps", steps):
        if stop is not None and stop.received:
            raise Preempted(
                f"stopped by {stop.received} during the warm start; nothing was cached or trained; "
                "rerun the same command to start again"
            )
        rows = [pool[rng.randrange(n)] for _ in range(batch_size)]
        pid, pmask, cid, cmask = demonstration_batch(tokenizer, task, rows, rng)
        logp, _ = token_logprobs(policy, pid, pmask, cid, cmask)  # [B, Tc]
        loss = -(logp * cmask).sum() / cmask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()


def warm_start(policy, tokenizer, task, cfg, key: dict, stop=None) -> dict:
    """Load the cached warm start for `key` (model, task and warm-start config) or train and cache
    it. `policy` must have been initialised from `cfg.seed` (see `applies`). Returns where the
    weights are cached and whether this call trained them ({} when there is no warm start)."""
    if not applies(cfg, task):
        return {}
    path = cache_path(
        cfg.cache_dir,
        {**key, "steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr, "seed": cfg.seed, "kernels": kernels()},
    )  # the kernels change its numbers
    weights = path / "weights.pt"  # plain torch.save: the same on every rank of a torchrun job
    with file_lock(path.with_name(path.name + ".lock")):  # a job that finds another training it waits, then loads
        why = atomic.damage(path) if path.exists() else "absent"
        if why not in (None, "absent"):
            print(f"rlkit: warm-start cache {path} is damaged ({why}); training it again", file=sys.stderr)
        trained = why is not None
        if trained:
            print(f"rlkit: warm start: {cfg.steps} supervised steps, cached in {path}", file=sys.stderr)
            train_supervised(policy, tokenizer, task, cfg.steps, cfg.batch_size, cfg.lr, cfg.seed, stop)
            with staged(path, "the warm-start cache (warm_start.cache_dir)") as tmp:
                tmp.mkdir(parents=True)
                torch.save(policy.state_dict(), tmp / weights.name)
                (tmp / "key.json").write_text(json.dumps(key, sort_keys=True, default=str, indent=1))
                atomic.write_manifest(tmp)
        policy.load_state_dict(torch.load(weights, weights_only=True))
    return {"cache": str(path), "trained": trained}
