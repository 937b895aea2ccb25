"""Fully sharded data parallel (`parallel=shard` under torchrun or SLURM; PyTorch's FSDP2 `fully_shard`):
each process holds 1/K of the policy's and the reference's parameters, gradients and optimizer
state, so a model that does not fit on one device trains on K. Each decoder layer (the model's
`_no_split_modules`) and the whole model are sharded; a forward gathers a layer's weights and
frees them after, and the backward reduces each layer's gradients across processes. Generation
gathers the whole policy once per call (`full_weights`), so the Llama decoder runs on full weights.
Checkpoints hold full (unsharded) state dicts, written by rank 0 and loaded by every rank."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

# torch.distributed's FSDP, DTensor and state-dict modules take seconds to import, so only a
# sharded run (`shard`) loads them; until it has, no model or tensor can be sharded.
FSDP, TENSOR = "torch.distributed.fsdp", "torch.distributed.tensor"


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    layers = set(getattr(model, "_no_split_modules", None) or [])
    for m in model.modules():
        if type(m).__name__ in layers:
            fully_shard(m, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)  # the root too, as `full_weights` restores it
    return model


def is_sharded(model) -> bool:
    return FSDP in sys.modules and isinstance(model, sys.modules[FSDP].FSDPModule)


@contextmanager
def full_weights(model: torch.nn.Module):
    """Every shard of `model` gathered for the block (one all-gather per group), released after;
    nothing for a model that is not sharded. Forwards inside the block run no collective, so
    processes may run different numbers of them (rows finish at different steps)."""
    groups = [m for m in model.modules() if is_sharded(m)]
    for m in groups:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)  # a forward inside the block gathers nothing again
    try:
        yield
    finally:
        for m in groups:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


def is_shard(t: torch.Tensor) -> bool:
    return TENSOR in sys.modules and isinstance(t, sys.modules[TENSOR].DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if is_shard(t) else t


def model_state(model: torch.nn.Module) -> dict:
    """The full state dict, on CPU (every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
