"""Checks of a run's inputs before it trains: the kernels pinned when `portable=true` asks for it,
the sampled evaluation's levels present in the held-out split, every prompt encodable by the
tokenizer, prompt plus budget within the model's context, and the rollout within the device's
free memory."""

from __future__ import annotations

import os

import torch

from rlkit.hardware import PORTABLE_ENV
from rlkit.refusals import ConfigError


def check_portable(portable: bool) -> None:
    """`portable=true` needs the kernels pinned to AVX2 before torch started (`PORTABLE_ENV`)."""
    pinned = all(os.environ.get(k) == v for k, v in PORTABLE_ENV.items())
    if portable and not (pinned and torch.backends.cpu.get_cpu_capability() == "AVX2"):
        raise ConfigError(
            f"portable=true: torch runs {torch.backends.cpu.get_cpu_capability()} kernels with "
            f"{', '.join(f'{k}={os.environ.get(k)}' for k in PORTABLE_ENV)} (the CPU lacks AVX2, or "
            f"the pins were not set before torch started: give portable=true on the command line or "
            f"set {' '.join(f'{k}={v}' for k, v in PORTABLE_ENV.items())} in the environment)"
        )


def check_encodable(tokenizer, splits: dict) -> None:
    """Every prompt must survive encoding: a character that comes back as the unknown token or not at
    all is named with its split and row. Special tokens written in the prompt (a chat template's
    `<|im_start|>`) come back as themselves; only the unknown token is dropped."""
    unk = tokenizer.unk_token_id
    for name, split in splits.items():
        prompts = [str(p) for p in split["prompt"]]
        ids = [[t for t in row if t != unk] for row in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        decoded = tokenizer.batch_decode(ids, skip_special_tokens=False)
        for i, (text, back) in enumerate(zip(prompts, decoded)):
            lost = sorted(set(text) - set(back) - set(" \t\n"))
            if lost:
                raise ConfigError(f"task.{name} row {i} ({text!r}) has characters the tokenizer cannot encode: {lost}")


def check_sample_levels(split, levels) -> None:
    """Each level of `eval.sample_levels` must be a difficulty that the held-out split has."""
    if not levels:
        return
    have = sorted({float(d) for d in split["difficulty"]}) if "difficulty" in split.column_names else []
    missing = [x for x in levels if float(x) not in have]
    if missing:
        raise ConfigError(
            f"eval.sample_levels={list(levels)}: the held-out split has no prompt of difficulty {missing} "
            f"(its levels: {', '.join(f'{d:g}' for d in have) or 'none, the task has no difficulty column'})"
        )


def check_context(tokenizer, model, splits: dict, max_new_tokens: int, key: str) -> None:
    """Every prompt plus the generation budget (the config `key`) must fit the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not limit:
        return
    for name, split in splits.items():
        lengths = [len(ids) for ids in tokenizer(list(split["prompt"]))["input_ids"]]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[i] + max_new_tokens > limit:
            raise ConfigError(
                f"task.{name} row {i} has a prompt of {lengths[i]} tokens; with "
                f"{key}={max_new_tokens} it exceeds the model's context of {limit}"
            )


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a new allocation on `device`: the GPU's free memory, or the system's
    MemAvailable on Linux; None where it cannot be known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_rollout_memory(model, rows: int, forward_rows: int, tokens: int, device: torch.device) -> None:
    """Refuses, before anything is allocated, a rollout whose generation (KV cache and per-step
    logits of `rows` sequences of `tokens`) or update forward (activations and logits of
    `forward_rows` sequences) would not fit the memory free on `device`. The estimate counts the
    largest tensors only, so it is a lower bound: a config it passes may still not fit."""
    c, free = model.config, available_memory(device)
    if free is None or not hasattr(c, "num_hidden_layers"):
        return
    size = next(model.parameters()).element_size()
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    layers, hidden, vocab = c.num_hidden_layers, c.hidden_size, c.vocab_size
    inner = getattr(c, "intermediate_size", 4 * hidden)
    generation = rows * (tokens * 2 * layers * kv * (hidden // heads) + 2 * vocab) * size
    update = forward_rows * tokens * (layers * (4 * hidden + 2 * inner) + vocab) * size
    if max(generation, update) > free:
        gib = 1 << 30
        raise ConfigError(
            f"rollout.prompts_per_step x rollout.group_size = {rows} completions of up to {tokens} tokens need at "
            f"least {generation / gib:.1f} GiB to generate and {update / gib:.1f} GiB for an update forward of "
            f"{forward_rows} rows; {free / gib:.1f} GiB are free on {device}. Lower rollout.group_size or "
            "rollout.prompts_per_step, or set optim.micro_batch_size for the update"
        )
