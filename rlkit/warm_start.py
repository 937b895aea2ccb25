"""Supervised warm start on the task's demonstrations, cached on disk keyed by its config, so RL
starts from a policy with partial accuracy."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch

from rlkit.rollout import encode_prompts, token_logprobs


def cache_path(cache_dir: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(os.path.expanduser(cache_dir)) / digest


def demonstration_batch(tokenizer, task, rows: list[dict], rng: random.Random):
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [r["prompt"] for r in rows])  # [B, Tp]
    demos = [task.demonstration(r, rng) + tokenizer.eos_token for r in rows]
    enc = tokenizer(demos, return_tensors="pt", padding=True, padding_side="right")
    return prompt_ids, prompt_mask, enc["input_ids"], enc["attention_mask"]  # [B, Tp] x2, [B, Tc] x2


def train_supervised(policy, tokenizer, task, steps: int, batch_size: int, lr: float, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    policy.train()
    n = len(task.train)
    for _ in range(steps):
        rows = [task.train[rng.randrange(n)] for _ in range(batch_size)]
        pid, pmask, cid, cmask = demonstration_batch(tokenizer, task, rows, rng)
        logp, _ = token_logprobs(policy, pid, pmask, cid, cmask)  # [B, Tc]
        loss = -(logp * cmask).sum() / cmask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()


def warm_start(policy, tokenizer, task, cfg, key: dict) -> bool:
    """Load the cached warm start for `key` (model, task and warm-start config) or train and cache
    it. Returns True when it came from the cache."""
    if cfg.steps == 0 or not hasattr(task, "demonstration"):
        return False
    path = cache_path(cfg.cache_dir, {**key, "steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr,
                                      "seed": cfg.seed})
    if (path / "config.json").exists():
        policy.load_state_dict(type(policy).from_pretrained(path).state_dict())
        return True
    train_supervised(policy, tokenizer, task, cfg.steps, cfg.batch_size, cfg.lr, cfg.seed)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(tmp)
    (tmp / "key.json").write_text(json.dumps(key, sort_keys=True, default=str, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return False
