"""Atomic checkpoints: a directory per step, written under a temporary name and renamed, holding
the policy and tokenizer in Hugging Face format plus `trainer_state.pt`, and last a manifest with
every file's SHA-256 that resume checks, so a damaged checkpoint is named and skipped. Loading
runs no code from the run directory: the trainer state holds tensors and plain Python data only
and is read with `weights_only=True`; anything else in it is refused with the file's name.
`save_run` and `resume` write and restore a whole run (every process's part). The directory around
the checkpoints (its lock, setting an earlier run aside) is `rlkit.rundir`'s."""

from __future__ import annotations

import copy
import pickle
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from rlkit import parallel
from rlkit.atomic import damage, staged, write_manifest
from rlkit.config import resolved
from rlkit.guards import NonFiniteError
from rlkit.refusals import ConfigError
from rlkit.state import Progress, Run

STATE = "trainer_state.pt"
# what checkpoints written before the RNG states were stored as plain data need, and nothing more
NUMPY_ARRAYS = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct,
]


class UnsafeCheckpoint(ValueError):
    """A trainer state that holds something other than tensors and plain data."""


def rng_state() -> dict:
    """Every generator's state as tensors and plain Python values (no numpy objects)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    if isinstance(n, dict):
        n = (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(n)


def save(
    run_dir: str | Path, step: int, models: dict, tokenizer, state: dict, keep: int = 2, rng_ranks: list | None = None
) -> Path:
    """Write checkpoints/step_XXXXXX atomically; `models` maps a sub-folder name to a function that
    saves into a directory ('policy' is saved with the tokenizer); `rng_ranks` holds every rank's RNG
    state (default: this process's)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    with staged(final, f"the step-{step} checkpoint") as tmp:
        for name, save_to in models.items():
            save_to(tmp / name)
        tokenizer.save_pretrained(tmp / "policy")
        torch.save({**state, "step": step, "rng_ranks": rng_ranks or [rng_state()]}, tmp / STATE)
        write_manifest(tmp)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: str | Path) -> Path | None:
    """Newest intact checkpoint directory, or None; damaged newer ones are named on stderr."""
    for path in sorted((Path(run_dir) / "checkpoints").glob("step_*"), reverse=True):
        why = damage(path)
        if why is None:
            return path
        print(f"rlkit: checkpoint {path} is damaged ({why}); trying the one before it", file=sys.stderr)
    return None


def load_state(path: Path) -> dict:
    """The trainer state of the checkpoint at `path`, read without running any code from it."""
    try:
        with torch.serialization.safe_globals(NUMPY_ARRAYS):
            return torch.load(path / STATE, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?i)unsupported global:?\s+(?:GLOBAL\s+)?(\S+)", str(e))  # not torch's advice
        what = f"it names {found.group(1)}" if found else "an object rlkit does not allow"
        raise UnsafeCheckpoint(
            f"{path / STATE} holds objects other than tensors and plain data, which rlkit "
            f"never writes ({what}); "
            "refusing to load it, since loading it could run code. Do not load it by other means "
            "unless you wrote it yourself"
        ) from None


# ---- which checkpoint resumes which run -----------------------------------------------------------------------

# What a resumed run may change: where and how fast it runs (the last digits of its numbers may
# differ), what it logs, when it evaluates and checkpoints, how long it runs (`steps`, not below the
# checkpoint's step), where the warm-start and model caches live and a reward call's time limit. Every other
# key of every group shapes training, and a difference is refused naming the keys.
MAY_CHANGE = (
    "steps",
    "device",
    "threads",
    "portable",
    "logger",
    "samples_every",
    "eval",
    "checkpoint",
    "warm_start.cache_dir",
    "model.cache_dir",
    "reward.timeout_s",
)


def changed_keys(saved, now, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two resolved configs, with their two values; a
    group whose class differs is named once, by its `_target_`s."""
    if isinstance(saved, dict) and isinstance(now, dict):
        if saved.get("_target_") != now.get("_target_"):
            return [f"{prefix.rstrip('.')} ({saved.get('_target_')} -> {now.get('_target_')})"]
        keys = [k for k in sorted({*saved, *now}, key=str) if f"{prefix}{k}" not in MAY_CHANGE]
        return [d for k in keys for d in changed_keys(saved.get(k), now.get(k), f"{prefix}{k}.")]
    return [] if saved == now else [f"{prefix.rstrip('.')} ({saved!r} -> {now!r})"]


# Groups and keys added after checkpoints were first written (dotted), with what a checkpoint
# without them ran; filled in only where the config it is compared with has them.
ADDED = {
    "environment": {"_target_": "rlkit.environments.SingleTurn"},
    "environment.error_reward": 0.0,
}


def filled(saved: dict, now: dict) -> dict:
    """`saved` with each key of `ADDED` that it lacks and `now` has (outer groups first)."""
    out = copy.deepcopy(saved)
    for key, value in ADDED.items():
        *outer, last = key.split(".")
        have, want = out, now
        for k in outer:
            have, want = have.get(k), want.get(k)
            if not (isinstance(have, dict) and isinstance(want, dict)):
                break
        else:
            if last in want and last not in have:
                have[last] = copy.deepcopy(value)
    return out


def check_resume(saved: dict | None, now: dict, path) -> None:
    """A checkpoint resumes only the run that wrote it: every key outside `MAY_CHANGE` must match (a
    checkpoint older than a key in `ADDED` ran with its value there)."""
    if saved is None:
        return
    diff = changed_keys(filled(saved, now), now)
    if diff:
        shown = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise ConfigError(
            f"the checkpoint {path} was written with different {shown}; "
            "use a new hydra.run.dir or checkpoint.resume=false to start over"
        )


def check_progress(state: dict, cfg, digest: dict, path) -> None:
    """The run may go on from the checkpoint: `steps` not below its step, and the task's rows (their
    SHA-256 per split) the ones it trained on."""
    if state["step"] > cfg.steps:
        raise ConfigError(
            f"steps={cfg.steps} is below the step of the checkpoint {path} ({state['step']}); "
            f"give steps >= {state['step']}, or checkpoint.resume=false to start over"
        )
    for split, sha in (state.get("data") or {}).items():
        if digest.get(split) != sha:
            raise ConfigError(
                f"the task's {split} rows differ from those the checkpoint {path} was trained on (the data "
                "changed since); restore them, or use a new hydra.run.dir or checkpoint.resume=false to start over"
            )


# ---- a run's checkpoints: save every process's part, resume, or set an earlier run aside ----------------------


def all_finite(model: torch.nn.Module) -> bool:
    """Whether this process's parameters (its shards, when sharded) are all finite: each one's
    least and greatest value (a NaN anywhere makes both NaN), without a [numel] mask per parameter."""
    local = (parallel.local(p) for p in model.parameters())
    return all(bool(torch.isfinite(torch.stack(torch.aminmax(x))).all()) for x in local if x.numel())


def save_run(run: Run, step: int) -> Path:
    """The checkpoint of `run` after `step` (every process takes part; rank 0 writes it)."""
    parts, rt = run.parts, run.runtime
    if parallel.any_rank(not all_finite(parts.policy)):  # never write a non-finite state over a good checkpoint
        raise NonFiniteError(f"the policy has non-finite weights at step {step}; checkpoint not written")
    rng_ranks = parallel.gather(rng_state())  # every rank's, so each resumes its own
    weights, optimizer = rt.parallel.policy_state(parts.policy, parts.optimizer)
    if rt.rank:
        return Path(rt.run_dir) / "checkpoints" / f"step_{step:06d}"
    models = {"policy": lambda path: parts.policy.save_pretrained(path, state_dict=weights)}
    extra = {}
    if parts.critic is not None:
        models["critic"] = parts.critic.save
        extra["critic_optimizer"] = parts.critic.state_dict()
    p = run.progress
    return save(
        rt.run_dir,
        step,
        models,
        parts.tokenizer,
        {
            "optimizer": optimizer,
            "schedule": parts.schedule.state_dict(),
            **extra,
            "sampler": parts.sampler.state_dict(),
            "engine": parts.engine.state_dict(),
            "loss": parts.loss.state_dict(),
            "first_eval": p.first_eval,
            "last_eval": p.last_eval,
            "run_id": rt.logger.run_id,
            "config": resolved(run.cfg),
            "data": parts.task.digest,
            "wall_s": run.wall_s(),
        },
        keep=run.cfg.checkpoint.keep,
        rng_ranks=rng_ranks,
    )


def resume(run: Run) -> None:
    """Load the run directory's last checkpoint into `run` (weights, optimizers, sampler position,
    the engine's and the loss's own state, RNG, progress); nothing when there is none."""
    parts, run_dir = run.parts, run.runtime.run_dir
    last = latest(run_dir)
    if last is None:
        if any((Path(run_dir) / "checkpoints").glob("step_*")):
            raise ConfigError(
                f"no intact checkpoint in {run_dir}/checkpoints (see above); use checkpoint.resume=false to start over"
            )
        return
    try:
        state = load_state(last)
    except UnsafeCheckpoint as e:
        raise ConfigError(str(e)) from None
    check_resume(state.get("config"), resolved(run.cfg), last)
    check_progress(state, run.cfg, parts.task.digest, last)
    try:
        load_parts(run, last, state)
    except pickle.UnpicklingError:  # a pickled weight file (torch refused it unrun): named, without torch's advice
        pickled = sorted(str(p) for p in last.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        raise ConfigError(
            f"the checkpoint {last} holds a pickled weight file with objects other than tensors "
            f"({', '.join(pickled) or 'a pickle'}), which rlkit never writes (it writes safetensors); refusing to "
            "load it, since loading it could run code. Do not load it by other means unless you wrote it yourself"
        ) from None
    except (KeyError, RuntimeError, ValueError, TypeError) as e:  # a checkpoint of another shape, from another version
        raise ConfigError(
            f"the checkpoint {last} does not fit this run ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
            "use a new hydra.run.dir or checkpoint.resume=false to start over"
        ) from e
    run.progress = Progress(
        state["step"],
        state.get("first_eval") or {},
        state.get("last_eval") or {},
        state.get("wall_s", 0.0),
        state["step"] >= run.cfg.steps,
        state.get("run_id"),
    )
    print(f"rlkit: resuming from {last} (step {state['step']})", file=sys.stderr)


def load_parts(run: Run, last: Path, state: dict) -> None:
    """Weights, optimizers, sampler position, the engine's and the loss's state and the RNG from a checkpoint."""
    parts = run.parts
    run.runtime.parallel.load_policy(parts.model, parts.policy, parts.optimizer, last / "policy", state["optimizer"])
    parts.schedule.load_state_dict(state["schedule"])
    if parts.critic is not None:
        parts.critic.load(last / "critic")
        parts.critic.load_state_dict(state["critic_optimizer"])
    parts.sampler.load_state_dict(state["sampler"])
    parts.engine.load_state_dict(state.get("engine", {}))
    parts.loss.load_state_dict(state.get("loss", {}))
    set_rng_state(state["rng_ranks"][run.runtime.rank % len(state["rng_ranks"])])
