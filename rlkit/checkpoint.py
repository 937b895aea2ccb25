"""Atomic checkpoints: a directory per step, written under a temporary name and renamed, holding
the policy and tokenizer in Hugging Face format plus `trainer_state.pt`, and last a manifest with
every file's SHA-256 that resume checks, so a damaged checkpoint is named and skipped."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

STATE, MANIFEST = "trainer_state.pt", "manifest.json"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def save(run_dir: str | Path, step: int, models: dict, tokenizer, state: dict, keep: int = 2,
         rng_ranks: list | None = None) -> Path:
    """Write checkpoints/step_XXXXXX atomically; `models` maps a sub-folder name to a function that
    saves into a directory ('policy' is saved with the tokenizer); `rng_ranks` holds every rank's RNG
    state (default: this process's)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, save_to in models.items():
        save_to(tmp / name)
    tokenizer.save_pretrained(tmp / "policy")
    torch.save({**state, "step": step, "rng_ranks": rng_ranks or [rng_state()]}, tmp / STATE)
    manifest = {str(p.relative_to(tmp)): _sha256(p) for p in _files(tmp)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when every file matches its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST} (written incompletely)"
    for name, digest in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} does not match its checksum"
    return None


def latest(run_dir: str | Path) -> Path | None:
    """Newest intact checkpoint directory, or None; damaged newer ones are named on stderr."""
    for path in sorted((Path(run_dir) / "checkpoints").glob("step_*"), reverse=True):
        why = damage(path)
        if why is None:
            return path
        print(f"rlkit: checkpoint {path} is damaged ({why}); trying the one before it", file=sys.stderr)
    return None


def load_state(path: Path) -> dict:
    return torch.load(path / STATE, weights_only=False)
