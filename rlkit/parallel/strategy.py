"""How the processes of a run share the model: one object, chosen at start-up (`choose`), owns
wrapping the models, gradient reduction, the policy's state for checkpoints and its own config
checks. `OneProcess`: one process, nothing to share. `Replicated` (`parallel=replicate`, the
default with several processes): each process holds the whole model and gradients are summed.
`Sharded` (`parallel=shard`): each holds 1/K of the policy and reference (see `sharding`)."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from rlkit.parallel import collectives, sharding
from rlkit.refusals import require

MODES = ("replicate", "shard")


class OneProcess:
    """A single process: the model whole, nothing to reduce."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    def check(self, cfg: DictConfig, advantage, sampler: type) -> None:
        """Refuse what this way of sharing cannot run (before any model is built)."""

    def wrap(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        return model

    def reduce_gradients(self, params) -> None:
        """After every rank's backward: the gradient of the whole batch's loss in each process."""

    def policy_state(self, policy: torch.nn.Module, optimizer) -> tuple[dict | None, dict]:
        """The policy's weights to save (None: its own `state_dict`) and the optimizer's state; every
        process calls it."""
        return None, optimizer.state_dict()

    def load_policy(self, model, policy: torch.nn.Module, optimizer, path, optimizer_state: dict) -> None:
        """Weights from a checkpoint's `policy` folder (through the model component) and the optimizer."""
        model.load(policy, path)
        optimizer.load_state_dict(optimizer_state)


class Replicated(OneProcess):
    """Every process holds the whole model and trains on its share of the prompts; gradients are summed."""

    def check(self, cfg: DictConfig, advantage, sampler: type) -> None:
        for g, component in (("advantage", advantage), ("sampler", sampler)):
            require(component.data_parallel, f"{g}={cfg[g]._target_} does not run data-parallel yet; use one process")
        P = cfg.rollout.prompts_per_step
        require(P % self.world == 0, f"rollout.prompts_per_step={P} must divide among {self.world} processes")
        generated = math.ceil(P * cfg.sampler.get("oversample", 1.0))
        require(
            generated % self.world == 0,
            f"rollout.prompts_per_step x sampler.oversample = {generated} prompts "
            f"per generation batch must divide among {self.world} processes",
        )

    def reduce_gradients(self, params) -> None:
        collectives.sum_gradients(params)


class Sharded(Replicated):
    """Each process holds 1/K of the policy's and the reference's parameters, gradients and
    optimizer state; checkpoints hold full state dicts."""

    def check(self, cfg: DictConfig, advantage, sampler: type) -> None:
        require(self.world > 1, "parallel=shard shards over several processes: start them with torchrun or srun")
        super().check(cfg, advantage, sampler)
        require(not advantage.needs_critic, "parallel=shard does not shard a critic yet: use a group estimator")
        require(not cfg.model.get("lora_r", 0), "parallel=shard with LoRA is not supported yet: use model.lora_r=0")
        require(
            sampler.even_shares and not cfg.optim.micro_batch_tokens,
            "parallel=shard needs as many micro-batches on every process: a sampler with even shares (not "
            "sampler=dapo) and optim.micro_batch_tokens=0",
        )

    def wrap(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        return model if model is None else sharding.shard(model)

    def reduce_gradients(self, params) -> None:
        for p in params:  # the backward reduced them already, as a mean over processes
            if p.requires_grad and p.grad is not None:
                p.grad.mul_(self.world)

    def policy_state(self, policy: torch.nn.Module, optimizer) -> tuple[dict | None, dict]:
        return sharding.model_state(policy), sharding.optimizer_state(policy, optimizer)

    def load_policy(self, model, policy: torch.nn.Module, optimizer, path, optimizer_state: dict) -> None:
        from transformers import AutoModelForCausalLM

        sharding.load_model_state(policy, AutoModelForCausalLM.from_pretrained(path).state_dict())
        sharding.load_optimizer_state(policy, optimizer, optimizer_state)


def choose(mode: str, rank: int, world: int) -> OneProcess:
    """The way of sharing for `parallel=mode` with `world` processes."""
    require(mode in MODES, f"parallel must be one of {list(MODES)}, got {mode!r}")
    if mode == "shard":
        return Sharded(rank, world)
    return Replicated(rank, world) if world > 1 else OneProcess(rank, world)
