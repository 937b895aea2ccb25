"""A run's state, split by lifetime: `Parts` (what the run is built from, fixed once built),
`Settings` (the loop's numbers and modes, read from the config once), `Progress` (what the loop
advances and a checkpoint restores) and `Runtime` (this process: its directory, device, parallel
strategy, logger, guards, clock). `Run` holds the four and the config."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig

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
from rlkit.config import eval_seed, shuffle_mode

if TYPE_CHECKING:  # for the annotations only: importing them here would load transformers and the strategies
    from transformers import PreTrainedTokenizerBase

    from rlkit.guards import NonFiniteGuard
    from rlkit.parallel.strategy import OneProcess


class Timer(dict):
    """Seconds spent per named block within a step: `with timer("generate"): ...`."""

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True, kw_only=True)
class Parts:
    """The built components and models (the objects keep their own internal state), built once
    by keyword (`setup.build_parts`)."""

    task: Task
    model: Model  # the model component: reference, loading weights
    policy: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    ref: torch.nn.Module | None  # frozen reference, only when loss.beta > 0
    critic: Critic | None  # only when the estimator needs one
    advantage: AdvantageEstimator
    aggregator: Aggregator
    loss: PolicyLoss
    correction: Correction
    environment: Environment
    reward_fns: dict[str, RewardFunction]  # {} = the task's own reward
    sampler: Sampler
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the loop's phases read of the config, read once when the run is built (`of`)."""

    steps: int
    group_size: int  # G
    max_new_tokens: int
    temperature: float  # the rollout's sampling temperature, also that of every log-prob
    top_p: float
    combine: str  # how reward terms combine (`reward.combine`)
    score_timeout_s: float
    shuffle: str  # the shuffled-reward control: none, step or group (`reward.shuffle`)
    overlong_cache: int
    epochs: int
    mini_batches: int
    micro_batch_size: int
    micro_batch_tokens: int
    share_prefix: str
    max_grad_norm: float
    eval_every: int
    samples_every: int
    evaluation: dict  # `evaluate`'s options
    old_logprobs: bool  # the old log-probs need a forward of their own (see `of`)
    old_statistic: str  # what that forward gives beside them: "metric" (entropy), "sum_pi_squared" or "none"
    coupled: int | None  # the seed that keys each sampled token's uniform (`rollout.coupled`), else None

    @classmethod
    def of(cls, cfg: DictConfig, parts: Parts) -> Settings:
        """`old_logprobs`: the old log-probs come free from the update itself (detached) unless the
        rollout is reused, the KL sits in the reward, the loss selects tokens by their entropy, the
        advantage needs the old policy's statistics, or the engine's numbers are not the trainer's."""
        rollout, optim, reward, held_out, loss = cfg.rollout, cfg.optim, cfg.reward, cfg.eval, parts.loss
        reused = optim.epochs > 1 or optim.mini_batches > 1
        stats = getattr(parts.advantage, "needs_policy_stats", False)
        return cls(
            steps=cfg.steps,
            group_size=rollout.group_size,
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            combine=reward.combine,
            score_timeout_s=reward.timeout_s,
            shuffle=shuffle_mode(reward.shuffle),
            overlong_cache=reward.overlong_cache,
            epochs=optim.epochs,
            mini_batches=optim.mini_batches,
            micro_batch_size=optim.micro_batch_size,
            micro_batch_tokens=optim.micro_batch_tokens,
            share_prefix=optim.share_prefix,
            max_grad_norm=optim.max_grad_norm,
            eval_every=held_out.every,
            samples_every=cfg.samples_every,
            evaluation=dict(
                batch_size=held_out.batch_size,
                max_new_tokens=held_out.max_new_tokens or rollout.max_new_tokens,
                samples=held_out.samples,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                seed=eval_seed(cfg),
                pass_k=tuple(held_out.pass_k),
                sample_levels=tuple(held_out.sample_levels),
                coupled=rollout.coupled,
            ),
            old_logprobs=reused or loss.kl_in_reward or loss.selects_tokens or stats or not parts.engine.exact_logprobs,
            old_statistic="sum_pi_squared" if stats else "metric" if loss.selects_tokens else "none",
            coupled=cfg.seed if rollout.coupled else None,
        )


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint."""

    start: int = 0  # last finished step (resume)
    first_eval: dict = field(default_factory=dict)
    last_eval: dict = field(default_factory=dict)
    wall_before: float = 0.0  # wall seconds of earlier sessions (resume)
    finished_before: bool = False  # resumed from the final checkpoint: nothing left to train
    run_id: str | None = None  # the logger's run, continued on resume


@dataclass
class Runtime:
    """This process's place in the run."""

    run_dir: str
    device: torch.device
    parallel: OneProcess  # the strategy (a subclass for several processes): rank, world, reductions
    logger: MetricSink | None = None  # set once the run is built
    guard: NonFiniteGuard | None = None
    timer: Timer = field(default_factory=Timer)
    t0: float = field(default_factory=time.perf_counter)  # this session's start
    spent: dict = field(default_factory=dict)  # this session's seconds by what they went to (build, eval, ...)
    step: int = 0  # the step being taken
    requests: int = 0  # rollouts the sampler has asked for in this step (keys of coupled draws)

    def request(self) -> tuple[int, int]:
        """The key of the sampler's next request for a rollout: (this step, its index in the step)."""
        self.requests += 1
        return self.step, self.requests - 1

    def spend(self, what: str, seconds: float) -> None:
        self.spent[what] = self.spent.get(what, 0.0) + seconds

    @property
    def rank(self) -> int:
        return self.parallel.rank


@dataclass
class Run:
    cfg: DictConfig
    parts: Parts
    settings: Settings
    progress: Progress
    runtime: Runtime

    def wall_s(self) -> float:
        """Wall seconds of every session of the run, set-up included."""
        return self.progress.wall_before + time.perf_counter() - self.runtime.t0
