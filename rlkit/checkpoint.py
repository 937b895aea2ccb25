"""Atomic checkpoints: a directory per step, written under a temporary name and renamed, holding
the policy and tokenizer in Hugging Face format plus `trainer_state.pt`."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

STATE = "trainer_state.pt"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save(run_dir: str | Path, step: int, models: dict, tokenizer, state: dict, keep: int = 2) -> Path:
    """Write checkpoints/step_XXXXXX atomically; `models` maps a sub-folder name to a function that
    saves into a directory ('policy' is saved with the tokenizer)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, save_to in models.items():
        save_to(tmp / name)
    tokenizer.save_pretrained(tmp / "policy")
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / STATE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: str | Path) -> Path | None:
    """Newest complete checkpoint directory, or None."""
    done = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / STATE).exists())
    return done[-1] if done else None


def load_state(path: Path) -> dict:
    return torch.load(path / STATE, weights_only=False)
