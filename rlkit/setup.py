"""Building a run: components from the config, models, optimizers, resume from a checkpoint, and
the Hydra app's paths. `setup` returns the one `RunState` that the loop's phases share."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset
import torch
from transformers import AutoModelForCausalLM
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlkit import checkpoint, distributed, files, fsdp
from rlkit.components import AdvantageEstimator, Aggregator, Critic, Engine, Model, PolicyLoss, Sampler
from rlkit.config import ConfigError, build, resolved
from rlkit.evaluate import evaluate
from rlkit.hardware import hardware
from rlkit.logging import NullLogger
from rlkit.guards import (EXIT_BAD_INPUT, NonFiniteError, NonFiniteGuard, all_finite, check_context, check_encodable,
                          check_resume, check_writable)
from rlkit.tasks.base import Task
from rlkit.warm_start import applies as warm_start_applies, warm_start


@dataclass
class RunState:
    """Everything the phases of a step share."""

    cfg: DictConfig
    run_dir: str
    device: torch.device
    task: Task
    model: Model                         # the model component: reference, loading weights
    policy: torch.nn.Module
    tokenizer: Any
    engine: Engine
    ref: torch.nn.Module | None          # frozen reference, only when loss.beta > 0
    critic: Critic | None                # only when the estimator needs one
    advantage: AdvantageEstimator
    aggregator: Aggregator
    loss: PolicyLoss
    reward_fns: dict                     # name -> RewardFunction; {} = the task's own reward
    sampler: Sampler
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    logger: Any = None
    guard: NonFiniteGuard | None = None
    eval_kw: dict = field(default_factory=dict)
    start: int = 0                       # last finished step (resume)
    first_eval: dict = field(default_factory=dict)
    last_eval: dict = field(default_factory=dict)
    timer: Any = None
    rank: int = 0                        # this process's rank and the number of processes (torchrun)
    world: int = 1
    t0: float = field(default_factory=time.perf_counter)  # this session's start
    wall_before: float = 0.0             # wall seconds of earlier sessions (resume)
    finished_before: bool = False        # resumed from the final checkpoint: nothing left to train

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.t0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(cfg: DictConfig, run_dir: str, run_info: dict, stop=None, rank: int = 0, world: int = 1) -> RunState:
    """Build every component and model of a validated config, warm-start, resume from the run
    directory's last checkpoint, start the logger and evaluate once before training. `stop`
    (`StopSignals`) lets a signal end the warm start early."""
    if cfg.warm_start.steps:
        check_writable(cfg.warm_start.cache_dir, "warm_start.cache_dir")
    if cfg.threads or run_info.get("threads"):
        torch.set_num_threads(cfg.threads or run_info["threads"])
    R, O = cfg.rollout, cfg.optim
    device = torch.device(distributed.local_device(cfg.device))
    task = build(cfg, "task")
    task.check_splits()
    advantage, aggregator, loss = build(cfg, "advantage"), build(cfg, "aggregator"), build(cfg, "loss")
    # a warm-started policy starts from warm_start.seed, so every RL seed shares it
    init_seed = cfg.warm_start.seed if warm_start_applies(cfg.warm_start, task) else cfg.seed
    model = build(cfg, "model")
    policy, tokenizer = model.build(task.alphabet, init_seed)
    if model.format_prompt(tokenizer, "1") != "1":  # e.g. a chat template: format every prompt once
        task.train, task.eval = (Dataset.from_list([{**r, "prompt": model.format_prompt(tokenizer, r["prompt"])}
                                                    for r in split]) for split in (task.train, task.eval))
    splits = {"train": task.train, "eval": task.eval}
    check_encodable(tokenizer, splits)
    check_context(tokenizer, policy, splits, R.max_new_tokens, "rollout.max_new_tokens")
    if cfg.eval.max_new_tokens:
        check_context(tokenizer, policy, {"eval": task.eval}, cfg.eval.max_new_tokens, "eval.max_new_tokens")
    warm = warm_start(policy, tokenizer, task, cfg.warm_start, {"model": resolved(cfg.model), "task": resolved(cfg.task)},
                      stop)
    policy.to(device)
    ref = model.reference(policy) if loss.beta > 0 else None
    if cfg.fsdp:  # after the reference copy and before the optimizer, which then holds shards
        policy, ref = fsdp.shard(policy), ref if ref is None else fsdp.shard(ref)
    critic = build(cfg, "critic", policy=policy, max_grad_norm=O.max_grad_norm) if advantage.needs_critic else None
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=O.lr, weight_decay=O.weight_decay, betas=(O.beta1, O.beta2))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (O.warmup_steps + 1)))
    sampler = build(cfg, "sampler", dataset=task.train, batch_size=R.prompts_per_step, seed=cfg.seed)
    engine = build(cfg, "engine", policy=policy, tokenizer=tokenizer)
    seed_everything(cfg.seed + rank)  # ranks sample differently; rank 0 as a single process would
    reward_fns = {name: build(cfg, f"reward.functions.{name}") for name in cfg.reward.functions}
    run = RunState(cfg, run_dir, device, task, model, policy, tokenizer, engine, ref, critic, advantage, aggregator, loss,
                   reward_fns, sampler, optimizer, schedule, guard=NonFiniteGuard(O.max_nonfinite),
                   eval_kw=dict(batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens or R.max_new_tokens,
                                samples=cfg.eval.samples, temperature=R.temperature, top_p=R.top_p, seed=cfg.eval.seed),
                   rank=rank, world=world)
    if rank == 0 and not cfg.checkpoint.resume:
        set_aside(run_dir)
    state = resume(run) if cfg.checkpoint.resume else {}
    if rank:  # rank 0 alone writes
        run.logger = NullLogger()
    else:
        run.logger = build(cfg, "logger", run_dir=run_dir, run_config=resolved(cfg), resume_step=run.start,
                           run_id=state.get("run_id"), run_info=run_info)
        files.write_text(Path(run_dir, "run.json"), json.dumps(
            {"choices": run_info.get("choices", {}), "config": resolved(cfg), "warm_start": warm, "processes": world,
             "fsdp": bool(cfg.fsdp), "hardware": hardware(device)}, indent=1))
    run.first_eval = state.get("first_eval") or evaluate(engine, tokenizer, task, **run.eval_kw)
    run.last_eval = state.get("last_eval", run.first_eval)
    if run.start == 0:
        run.logger.log(0, run.first_eval)
    return run


def resume(run: RunState) -> dict:
    """Load the run directory's last checkpoint into `run` (weights, optimizers, sampler position,
    RNG, step) and return its saved state; {} when there is none."""
    last = checkpoint.latest(run.run_dir)
    if last is None:
        if any((Path(run.run_dir) / "checkpoints").glob("step_*")):
            raise ConfigError(f"no intact checkpoint in {run.run_dir}/checkpoints (see above); "
                              "use checkpoint.resume=false to start over")
        return {}
    try:
        state = checkpoint.load_state(last)
    except checkpoint.UnsafeCheckpoint as e:
        raise ConfigError(str(e)) from None
    check_resume(state.get("config"), resolved(run.cfg), last)
    if fsdp.is_sharded(run.policy):
        fsdp.load_model_state(run.policy, AutoModelForCausalLM.from_pretrained(last / "policy").state_dict())
        fsdp.load_optimizer_state(run.policy, run.optimizer, state["optimizer"])
    else:
        run.model.load(run.policy, last / "policy")
        run.optimizer.load_state_dict(state["optimizer"])
    run.schedule.load_state_dict(state["schedule"])
    if run.critic is not None:
        run.critic.load(last / "critic")
        run.critic.load_state_dict(state["critic_optimizer"])
    run.sampler.load_state_dict(state["sampler"])
    checkpoint.set_rng_state(state["rng_ranks"][run.rank % len(state["rng_ranks"])])
    run.start, run.wall_before = state["step"], state.get("wall_s", 0.0)
    run.finished_before = run.start >= run.cfg.steps
    print(f"rlkit: resuming from {last} (step {run.start})", file=sys.stderr)
    return state


HYDRA_FILES = {".hydra", "train.log", ".rlkit.lock"}  # what Hydra and the lock write for every run
PREVIOUS = "previous_runs"


def set_aside(run_dir: str) -> Path | None:
    """Starting over (`checkpoint.resume=false`) in a directory that holds an earlier run: its files
    (checkpoints, metrics, summary, wandb) move to `previous_runs/<time>/`, so nothing of it mixes
    with the new run and nothing is deleted."""
    old = [p for p in Path(run_dir).iterdir() if p.name not in HYDRA_FILES | {PREVIOUS}]
    if not old:
        return None
    dest = Path(run_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S"))
    dest = next(d for d in (dest.with_name(f"{dest.name}{'' if i == 0 else f'_{i}'}") for i in range(1000))
                if not d.exists())
    dest.mkdir(parents=True)
    for p in old:
        os.replace(p, dest / p.name)
    print(f"rlkit: checkpoint.resume=false: the earlier run's files in {run_dir} moved to {dest}", file=sys.stderr)
    return dest


def save_checkpoint(run: RunState, step: int) -> Path:
    if distributed.any_rank(not all_finite(run.policy)):  # never write a non-finite state over a good checkpoint
        raise NonFiniteError(f"the policy has non-finite weights at step {step}; checkpoint not written")
    rng_ranks = distributed.gather(checkpoint.rng_state())  # every rank's, so each resumes its own
    sharded = fsdp.is_sharded(run.policy)
    weights = fsdp.model_state(run.policy) if sharded else None  # every rank takes part in gathering
    optimizer = fsdp.optimizer_state(run.policy, run.optimizer) if sharded else run.optimizer.state_dict()
    if run.rank:
        return Path(run.run_dir) / "checkpoints" / f"step_{step:06d}"
    models = {"policy": lambda path: run.policy.save_pretrained(path, state_dict=weights)}
    extra = {}
    if run.critic is not None:
        models["critic"] = run.critic.save
        extra["critic_optimizer"] = run.critic.state_dict()
    return checkpoint.save(run.run_dir, step, models, run.tokenizer,
                           {"optimizer": optimizer, "schedule": run.schedule.state_dict(), **extra,
                            "sampler": run.sampler.state_dict(), "first_eval": run.first_eval,
                            "last_eval": run.last_eval, "run_id": run.logger.run_id, "config": resolved(run.cfg),
                            "wall_s": run.wall_s()},
                           keep=run.cfg.checkpoint.keep, rng_ranks=rng_ranks)


class ComposeCheck(Callback):
    """Notes that Hydra composed the config, so `rlkit-train` can tell a composition error (bad
    input, exit 2) from a failure inside a run. Before Hydra writes into the run directory it checks
    that the directory is writable (else exit 2 naming the key) and keeps the `.hydra/` files an
    earlier run left there, so that a refused run can put them back (`restore_hydra_files`)."""

    composed = False
    saved: dict = {}     # path -> bytes of the run directory's .hydra files before this run
    existed: set = set()  # the run directory and the folders above it that existed before this run

    def on_run_start(self, config, **kwargs) -> None:
        ComposeCheck.composed = True
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
        ComposeCheck.existed = {q for q in (run_dir.resolve(), *run_dir.resolve().parents) if q.is_dir()}
        try:
            check_writable(run_dir, "hydra.run.dir")
        except ConfigError as e:
            print(f"rlkit: error: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        hydra_dir = run_dir / str(OmegaConf.select(config, "hydra.output_subdir") or ".hydra")
        ComposeCheck.saved = {p: p.read_bytes() for p in hydra_dir.glob("*.yaml")} if hydra_dir.is_dir() else {}

    def on_multirun_start(self, config, **kwargs) -> None:
        ComposeCheck.composed = True


def discard_refused(run_dir: str) -> None:
    """After a refused run: put back the `.hydra/` files an earlier run had in `run_dir`; or, when
    the directory holds nothing but Hydra's own files of this run, remove it and the folders above
    it that this run created, up to the working directory."""
    existed = ComposeCheck.existed
    if ComposeCheck.saved:
        for p, data in ComposeCheck.saved.items():
            p.write_bytes(data)
        return
    path, cwd = Path(run_dir).resolve(), Path.cwd().resolve()
    if path == cwd or cwd not in path.parents or not path.is_dir() or \
            not {p.name for p in path.iterdir()} <= HYDRA_FILES or path in existed:
        return
    shutil.rmtree(path, ignore_errors=True)
    for parent in path.parents:
        if parent == cwd or parent in existed or any(parent.iterdir()):
            break
        parent.rmdir()


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
