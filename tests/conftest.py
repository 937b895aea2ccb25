"""Shared test helpers: real Hydra composition of the packaged config, and a tiny fast run."""

from __future__ import annotations

import os
import subprocess

import pytest
from hydra import compose, initialize_config_module

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# A run small enough for a test: 1-layer model, few prompts, short warm start.
FAST = [
    "steps=2",
    "threads=1",
    "logger=jsonl",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    "model.hidden_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "task.n_train=64",
    "task.n_eval=8",
    "task.max_terms=2",
    "warm_start.steps=150",
    "warm_start.batch_size=32",
    "warm_start.lr=5e-3",
    "eval.every=1",
    "checkpoint.every=1",
]


def make_cfg(overrides: list[str] = (), cache_dir: str | None = None):
    extra = [f"warm_start.cache_dir={cache_dir}"] if cache_dir else []
    swapped = {o.split("=")[0] for o in overrides if o.split("=")[0] in ("task", "model")}
    fast = [o for o in FAST if o.split(".")[0] not in swapped]  # another task or model: drop the testbed's sizes
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        return compose(config_name="config", overrides=[*fast, *extra, *overrides])


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> str:
    """One warm-start cache for the tests that do not test the cache itself, shared by the test
    processes of the session (pytest-xdist's workers share the parent of their temporary roots):
    each configuration's warm start is trained once, under the cache's file lock, then loaded."""
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "warm_start"
    shared.mkdir(exist_ok=True)
    return str(shared)


@pytest.fixture
def fast_cfg(warm_cache):
    """Compose the packaged config with FAST overrides plus the given ones; warm start from the session's cache."""
    return lambda *overrides: make_cfg(list(overrides), cache_dir=warm_cache)


def save_tiny_qwen2(path, alphabet: str, max_positions: int = 64, chat_template: str | None = None):
    """A tiny Qwen2 with random weights and a character tokenizer, saved as a user's checkpoint would be."""
    from rlkit.models import TinyQwen2

    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model, tok = TinyQwen2(**sizes, max_position_embeddings=max_positions).build(alphabet, 0)
    tok.chat_template = chat_template
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """`save_tiny_qwen2` for the testbed's alphabet."""
    from rlkit.tasks.arithmetic import ALPHABET

    return save_tiny_qwen2(tmp_path_factory.mktemp("hf"), ALPHABET)


def tmpfs(tmp_path, size: str):
    """A tmpfs of `size` mounted at tmp_path/disk (needs root; skips where it cannot mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (not root): the full-disk tests need one")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


@pytest.fixture
def tiny_disk(tmp_path):
    """A 150 KiB tmpfs: room for the run's small files, not for a checkpoint."""
    yield from tmpfs(tmp_path, "150k")


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of the size the test asks for (indirect parametrisation)."""
    yield from tmpfs(tmp_path, request.param)
