"""Building a run: the config checked (its values, then one build of the components that need no
model, then what each built component can do), the models, optimizers and the rest built once,
a warm start, resume and the first evaluation. `setup` returns the `Run` the loop's phases share."""

from __future__ import annotations

import functools
import inspect
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from datasets import Dataset
from omegaconf import DictConfig
from transformers.utils import logging as hf_logging

from rlkit import atomic, checkpoint, parallel, rundir
from rlkit.components import (
    AdvantageEstimator,
    Aggregator,
    Correction,
    Critic,
    Engine,
    Environment,
    MetricSink,
    Model,
    PolicyLoss,
    RewardFunction,
    Sampler,
    Task,
)
from rlkit.config import build, check_values, chosen, resolved, target_class
from rlkit.environments import Checked
from rlkit.evaluate import timed_eval
from rlkit.guards import NonFiniteGuard
from rlkit.hardware import hardware, keep_freed_memory
from rlkit.preflight import check_context, check_encodable, check_rollout_memory, check_sample_levels
from rlkit.refusals import check, require
from rlkit.sinks import NullLogger
from rlkit.state import Parts, Progress, Run, Runtime, Settings
from rlkit.warm_start import applies as warm_start_applies
from rlkit.warm_start import warm_start

hf_logging.disable_progress_bar()
datasets.disable_progress_bars()  # a "Map" bar per split formatted: noise in a run's output


@dataclass(frozen=True)
class Validated:
    """What `validate` builds from the config alone, once, before any model: checked, then handed to
    `setup`, which puts them into the run's `Parts`."""

    advantage: AdvantageEstimator
    aggregator: Aggregator
    loss: PolicyLoss
    correction: Correction
    environment: Environment
    reward_fns: dict  # name -> RewardFunction
    parallel: parallel.OneProcess  # how the processes share the model


def validate(cfg: DictConfig, world: int = 1, rank: int = 0) -> Validated:
    """Every check that needs no model, before anything expensive is built or written: the config's
    values, the component classes, one build of the components that need no model, then what the
    built ones can do (with `world` processes)."""
    check_values(cfg)
    for g, kind in (("advantage", AdvantageEstimator), ("sampler", Sampler)):  # they declare `min_group_size`
        cls = target_class(cfg, g)
        check(cls, kind, g)
        require(
            cfg.rollout.group_size >= cls.min_group_size,
            f"{g}={cfg[g]._target_} needs rollout.group_size >= {cls.min_group_size}, got {cfg.rollout.group_size}",
        )
    check(target_class(cfg, "engine"), Engine, "engine")
    out = Validated(
        advantage=build(cfg, "advantage", AdvantageEstimator),
        aggregator=build(cfg, "aggregator", Aggregator),
        loss=build(cfg, "loss", PolicyLoss),
        correction=build(cfg, "correction", Correction),
        environment=checked_environment(cfg),
        reward_fns={name: build(cfg, f"reward.functions.{name}", RewardFunction) for name in cfg.reward.functions},
        parallel=parallel.choose(cfg.parallel, rank, world),
    )
    check_built(cfg, out)
    return out


def checked_environment(cfg: DictConfig) -> Checked:
    """The environment built and held to its contract (`rlkit.environments.Checked`)."""
    env = build(cfg, "environment", Environment)
    check(env, Environment, "environment")
    return Checked(env)


def check_episodes(cfg: DictConfig, environment: Environment) -> None:
    """A multi-turn environment needs an engine that runs episodes (`multi_turn = True`)."""
    require(
        environment.max_turns == 1 or getattr(target_class(cfg, "engine"), "multi_turn", False),
        f"environment={cfg.environment._target_} runs multi-turn episodes, which engine={cfg.engine._target_} cannot",
    )


def check_built(cfg: DictConfig, c: Validated) -> None:
    """What the built components declare: a critic when the estimator needs one, the Protocols, finite
    reward weights, and what the parallel strategy can run."""
    if c.advantage.needs_critic:
        require(chosen(cfg, "critic"), f"advantage={cfg.advantage._target_} needs a critic: add critic=value")
        check(target_class(cfg, "critic"), Critic, "critic")
    stats = getattr(c.advantage, "needs_policy_stats", False)
    require(
        not (stats and c.loss.selects_tokens),
        f"advantage={cfg.advantage._target_} needs the old policy's sum pi^2 from the forward that "
        "loss.top_entropy_quantile < 1 needs for the entropies: use one of the two",
    )
    check(c.aggregator, Aggregator, "aggregator")
    check(c.loss, PolicyLoss, "loss")
    check(c.correction, Correction, "correction")
    check_episodes(cfg, c.environment)
    for name, fn in c.reward_fns.items():
        check(fn, RewardFunction, f"reward.functions.{name}")
        weight = fn.weight
        require(
            isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
            f"reward.functions.{name}.weight must be a finite number, got {weight!r}",
        )
    c.parallel.check(cfg, c.advantage, target_class(cfg, "sampler"))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_task_and_model(cfg: DictConfig, stop, device: torch.device, environment, world: int = 1) -> tuple:
    """The task, the model component, the warm-started policy (on the CPU) and its tokenizer; every
    prompt checked against the tokenizer and the context, and the rollout's size against the memory
    of `device` (each of `world` processes holding its share); each prompt after the environment's
    `preamble` messages. Returns (task, model, policy, tokenizer, warm-start info)."""
    task = build(cfg, "task", Task)
    task.check_splits()
    check_sample_levels(task.eval, cfg.eval.sample_levels)
    need = getattr(task, "requires_environment", None)  # a task scored by its episodes (task=verifiers)
    require(
        need is None or isinstance(getattr(environment, "inner", environment), need),
        f"task={cfg.task._target_} is scored by its episodes, which only "
        f"environment={getattr(need, '__name__', '')} runs",
    )
    # a warm-started policy starts from warm_start.seed, so every RL seed shares it
    init_seed = cfg.warm_start.seed if warm_start_applies(cfg.warm_start, task) else cfg.seed
    model = build(cfg, "model", Model)
    policy, tokenizer = model.build(task.alphabet, init_seed)
    format_prompts(task, model, tokenizer, environment.preamble)
    splits = {"train": task.train, "eval": task.eval}
    check_encodable(tokenizer, splits)
    check_context(tokenizer, policy, splits, cfg.rollout.max_new_tokens, "rollout.max_new_tokens")
    if cfg.eval.max_new_tokens:
        check_context(tokenizer, policy, {"eval": task.eval}, cfg.eval.max_new_tokens, "eval.max_new_tokens")
    rollout, optim = cfg.rollout, cfg.optim
    rows = -(-rollout.prompts_per_step * rollout.group_size // world)
    prompt = max(len(ids) for ids in tokenizer(list(task.train["prompt"]))["input_ids"])
    check_rollout_memory(
        policy, rows, optim.micro_batch_size or -(-rows // optim.mini_batches), prompt + rollout.max_new_tokens, device
    )
    warm = warm_start(
        policy, tokenizer, task, cfg.warm_start, {"model": resolved(cfg.model), "task": resolved(cfg.task)}, stop
    )
    return task, model, policy, tokenizer, warm


def format_prompts(task: Task, model: Model, tokenizer, preamble: tuple) -> None:
    """Every prompt formatted once for the model (e.g. its chat template), after the `preamble` chat
    messages when there are any, keeping the task's own as `task_prompt` (its demonstrations read it)."""
    if preamble:
        require(
            getattr(tokenizer, "chat_template", None),
            "environment.preamble holds chat messages, which need a model with a chat template",
        )

        def formatted(prompt: str) -> str:
            chat = [*preamble, {"role": "user", "content": prompt}]
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    elif model.format_prompt(tokenizer, "1") != "1":
        formatted = functools.partial(model.format_prompt, tokenizer)
    else:
        return
    task.train, task.eval = (
        Dataset.from_list([{**r, "prompt": formatted(r["prompt"]), "task_prompt": r["prompt"]} for r in split])
        for split in (task.train, task.eval)
    )


def build_parts(cfg: DictConfig, c: Validated, device: torch.device, stop) -> tuple[Parts, dict]:
    """Everything the loop uses, built once; returns the parts and the warm start's info."""
    task, model, policy, tokenizer, warm = build_task_and_model(cfg, stop, device, c.environment, c.parallel.world)
    policy.to(device)
    ref = model.reference(policy) if c.loss.beta > 0 else None
    # wrapped after the reference copy and before the optimizer, which then holds what this process owns
    policy, ref = c.parallel.wrap(policy), c.parallel.wrap(ref)
    optim = cfg.optim
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA: the adapters only
    hyper = dict(lr=optim.lr, weight_decay=optim.weight_decay, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    # fused: one pass over each tensor instead of about ten, the same update to float rounding
    optimizer = torch.optim.AdamW(trainable, **hyper, fused=not parallel.is_sharded(policy))
    critic = (
        build(cfg, "critic", Critic, policy=policy, max_grad_norm=optim.max_grad_norm)
        if c.advantage.needs_critic
        else None
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (optim.warmup_steps + 1)))
    sampler = build(cfg, "sampler", Sampler, dataset=task.train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed)
    engine = build(cfg, "engine", Engine, policy=policy, tokenizer=tokenizer)
    parts = Parts(
        task=task,
        model=model,
        policy=policy,
        tokenizer=tokenizer,
        engine=engine,
        ref=ref,
        critic=critic,
        advantage=c.advantage,
        aggregator=c.aggregator,
        loss=c.loss,
        correction=c.correction,
        environment=c.environment,
        reward_fns=c.reward_fns,
        sampler=sampler,
        optimizer=optimizer,
        schedule=schedule,
    )
    return parts, warm


def start_logging(run: Run, c: Validated, run_info: dict, warm: dict):
    """The run's logger, and `run.json` (choices, resolved config, warm start, processes, hardware)."""
    cfg, run_dir = run.cfg, run.runtime.run_dir
    logger = build(
        cfg,
        "logger",
        MetricSink,
        run_dir=run_dir,
        run_config=resolved(cfg),
        resume_step=run.progress.start,
        run_id=run.progress.run_id,
        run_info=run_info,
    )
    info = {
        "choices": run_info.get("choices", {}),
        "config": resolved(cfg),
        "warm_start": warm,
        "processes": c.parallel.world,
        "parallel": type(c.parallel).__name__,
        "hardware": hardware(run.runtime.device),
        **({"job": run_info["job"]} if "job" in run_info else {}),  # its number in a sweep
    }
    atomic.write_text(Path(run_dir, "run.json"), json.dumps(info, indent=1))
    return logger


def setup(cfg: DictConfig, run_dir: str, run_info: dict, validated: Validated | None = None, stop=None) -> Run:
    """Build the run of a validated config (`validated` from `validate`; validated here when not
    given), warm-start, resume from the run directory's last checkpoint, start the logger and
    evaluate once before training. `stop` (`StopSignals`) lets a signal end the warm start early."""
    c = validated or validate(cfg)
    if cfg.warm_start.steps:
        atomic.check_writable(cfg.warm_start.cache_dir, "warm_start.cache_dir")
    if cfg.threads or run_info.get("threads"):
        torch.set_num_threads(cfg.threads or run_info["threads"])
    keep_freed_memory()
    rank = c.parallel.rank
    device = torch.device(parallel.local_device(cfg.device))
    built = time.perf_counter()
    parts, warm = build_parts(cfg, c, device, stop)
    require(
        not cfg.rollout.coupled or "draws" in inspect.signature(parts.engine.generate).parameters,
        f"rollout.coupled=true: engine {type(parts.engine).__name__}.generate takes no `draws` (keyed uniforms)",
    )
    built = time.perf_counter() - built
    seed_everything(cfg.seed + rank)  # ranks sample differently; rank 0 as a single process would
    runtime = Runtime(run_dir, device, c.parallel, guard=NonFiniteGuard(cfg.optim.max_nonfinite))
    runtime.spend("build", built)  # models, data, the warm start
    run = Run(cfg, parts, Settings.of(cfg, parts), Progress(), runtime)
    if rank == 0:  # it holds the directory's lock: temporary files there are of writers that died
        rundir.remove_stale_temporaries(run_dir)
    if rank == 0 and not cfg.checkpoint.resume:
        rundir.set_aside(run_dir, run_info.get("earlier_hydra"))
    if cfg.checkpoint.resume:
        checkpoint.resume(run)
    run.runtime.logger = NullLogger() if rank else start_logging(run, c, run_info, warm)  # rank 0 alone writes
    p, timing = run.progress, {}
    if not p.first_eval:  # a resumed run keeps its checkpoint's
        p.first_eval, timing["time/eval"] = timed_eval(run)
    p.last_eval = p.last_eval or p.first_eval
    if p.start == 0:
        run.runtime.logger.log(0, {**p.first_eval, **timing})
    return run
