"""Run safety: preemption signals, non-finite updates, checks on the run's inputs and outputs."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from rlkit import parallel
from rlkit.config import ConfigError


class Preempted(Exception):
    """SIGTERM or SIGINT arrived; a checkpoint was written and rerunning the command resumes."""


class StoppedAtOnce(BaseException):
    """A second SIGTERM or SIGINT arrived before the step ended: stopped without a checkpoint. A
    BaseException, like KeyboardInterrupt, so that no handler of user code (a scorer's) swallows it."""


class NonFiniteError(RuntimeError):
    """Too many non-finite updates in a row."""


class StopSignals:
    """Records SIGTERM/SIGINT instead of dying mid-step; the loop checks `received` after each step.
    A second signal raises `StoppedAtOnce` wherever the run is (a scorer that never returns, say)."""

    def __init__(self):
        self.received: str | None = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received:  # a second signal: the step is not ending (a hung scorer, say); stop now
            raise StoppedAtOnce(
                f"stopped at once by a second signal ({signal.Signals(signum).name} after "
                f"{self.received}); no checkpoint was written for this step; rerun the same command "
                "to resume from the last checkpoint"
            )
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class NonFiniteGuard:
    """Counts updates skipped for a NaN or inf loss, advantage or gradient norm; too many in a row stop the run."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, 0

    def record(self, skipped: bool, step: int) -> None:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += skipped
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"{self.in_a_row} non-finite updates in a row (last at step {step}); stopping. "
                "The last checkpoint holds the last good state (optim.max_nonfinite sets the limit)"
            )


def checked_advantages(estimator, rollout, values=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call the estimator; its advantages (and returns, if it gives them) must be float tensors of
    the rollout's [N, Tc] shape. A failure names the estimator, before any update."""
    name = type(estimator).__qualname__
    try:
        out = estimator(rollout, values)
    except Exception as e:  # a plugin's bug: name it and the rollout it failed on
        raise ConfigError(
            f"advantage={name} raised on a rollout of {rollout.num_rows} rows: {type(e).__name__}: {e}"
        ) from e
    adv, returns = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    expect = tuple(rollout.completion_mask.shape)
    named = [("advantages", adv)] + ([("returns", returns)] if returns is not None else [])
    for what, x in named:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != expect or not x.is_floating_point():
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(
                f"advantage={name} returned {what} of shape {got}; expected a float tensor of shape "
                f"[N, Tc] = {list(expect)} (see rlkit.components.AdvantageEstimator)"
            )
    return adv, returns


def finite(*xs) -> bool:
    return all(bool(torch.isfinite(torch.as_tensor(x)).all()) for x in xs)


def all_finite(model: torch.nn.Module) -> bool:
    """Whether this process's parameters (its shards, when sharded) are all finite."""
    return all(bool(torch.isfinite(parallel.local(p)).all()) for p in model.parameters())


def check_writable(path: str | Path, key: str) -> None:
    """Create `path` and write a probe file there, or fail naming the key."""
    path = Path(os.path.expanduser(str(path)))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".rlkit_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}: directory {path} is not writable ({e.strerror or e})") from e


@contextmanager
def file_lock(path: Path, wait: bool = True):
    """An exclusive flock on the file `path` for the block; it dies with its process, however the
    process ends. `wait=False`: raise BlockingIOError at once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class RunDirLock:
    """Refuses a run directory that another live run holds (`.rlkit.lock`), so a killed run's
    directory can be resumed at once."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".rlkit.lock"
        self.lock = file_lock(self.path, wait=False)

    def __enter__(self):
        try:
            f = self.lock.__enter__()
        except BlockingIOError:
            holder = self.path.read_text().strip() or "another process"
            raise ConfigError(
                f"hydra.run.dir: {self.path.parent} is in use by a live run ({holder}); "
                "wait for it, or choose another hydra.run.dir"
            ) from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}")
        f.flush()
        return self

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


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


RESUME_KEYS = (
    "seed",
    "advantage",
    "aggregator",
    "sampler",
    "task",
    "model",
    "rollout",
    "loss",
    "reward",
    "optim",
    "warm_start",
    "parallel",
)  # a sharded optimizer state is keyed by parameter name, not by position


def _training_key(cfg: dict, key: str):
    value = cfg.get(key)
    if key in ("warm_start", "reward") and value:  # the cache may move; a time limit does not shape training
        value = {k: v for k, v in value.items() if k not in ("cache_dir", "timeout_s")}
    return value


def check_resume(saved: dict | None, now: dict, path) -> None:
    """A checkpoint resumes only the run that wrote it: the keys that shape training must match."""
    if saved is None:
        return
    diff = [k for k in RESUME_KEYS if _training_key(saved, k) != _training_key(now, k)]
    if diff:
        raise ConfigError(
            f"the checkpoint {path} was written with different {', '.join(diff)}; "
            "use a new hydra.run.dir or checkpoint.resume=false to start over"
        )
