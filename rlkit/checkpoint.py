"""Atomic checkpoints: a directory per step, written under a temporary name and renamed, holding
the policy and tokenizer in Hugging Face format plus `trainer_state.pt`, and last a manifest with
every file's SHA-256 that resume checks, so a damaged checkpoint is named and skipped. Loading
runs no code from the run directory: the trainer state holds tensors and plain Python data only
and is read with `weights_only=True`; anything else in it is refused with the file's name."""
from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from rlkit.files import staged

STATE, MANIFEST = "trainer_state.pt", "manifest.json"
# what checkpoints written before the RNG states were stored as plain data need, and nothing more
NUMPY_ARRAYS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]


class UnsafeCheckpoint(ValueError):
    """A trainer state that holds something other than tensors and plain data."""


def rng_state() -> dict:
    """Every generator's state as tensors and plain Python values (no numpy objects)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    if isinstance(n, dict):
        n = (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(n)


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
    with staged(final, f"the step-{step} checkpoint") as tmp:
        for name, save_to in models.items():
            save_to(tmp / name)
        tokenizer.save_pretrained(tmp / "policy")
        torch.save({**state, "step": step, "rng_ranks": rng_ranks or [rng_state()]}, tmp / STATE)
        write_manifest(tmp)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_manifest(folder: Path) -> None:
    """`manifest.json` with the SHA-256 of every other file under `folder`, checked by `damage`."""
    manifest = {str(p.relative_to(folder)): _sha256(p) for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


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
    """The trainer state of the checkpoint at `path`, read without running any code from it."""
    try:
        with torch.serialization.safe_globals(NUMPY_ARRAYS):
            return torch.load(path / STATE, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(f"{path / STATE} holds objects other than tensors and plain data, which rlkit "
                               f"never writes; refusing to load it (it could run code). {str(e).splitlines()[0]}") \
            from None
