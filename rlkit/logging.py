"""Metric sinks. `metrics.jsonl` in the run directory is the source of truth; wandb mirrors it."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class JsonlLogger:
    """One JSON line per step in `<run_dir>/metrics.jsonl`."""

    def __init__(self, run_dir: str, run_config: dict, resume_step: int = 0, run_id: str | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.exists():  # drop lines past the checkpoint we resume from
            keep = [l for l in self.path.read_text().splitlines() if l and json.loads(l)["step"] <= resume_step]
            self.path.write_text("".join(l + "\n" for l in keep))
        elif not resume_step:
            self.path.write_text("")
        self.run_id = None

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: (v if isinstance(v, (int, str)) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")

    def finish(self) -> None:
        pass


class WandbLogger(JsonlLogger):
    """Also logs to wandb: offline unless WANDB_MODE or `mode` says otherwise. If wandb cannot
    start, training goes on with metrics.jsonl and says so once."""

    def __init__(self, run_dir: str, run_config: dict, resume_step: int = 0, project: str = "rlkit",
                 mode: str | None = None, group: str | None = None, tags: list | None = None,
                 name: str | None = None, run_id: str | None = None):
        super().__init__(run_dir, run_config, resume_step)
        self.run = None
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=project, dir=run_dir, config=_flatten(run_config),
                                  mode=mode or os.environ.get("WANDB_MODE", "offline"), group=group,
                                  tags=list(tags or []), name=name, id=run_id, resume="allow" if run_id else None,
                                  reinit="finish_previous")
            self.run_id = self.run.id
        except Exception as e:  # noqa: BLE001 - any wandb failure must not stop training
            print(f"rlkit: wandb could not start ({type(e).__name__}: {e}); logging to {self.path} only",
                  file=sys.stderr)

    def log(self, step: int, metrics: dict) -> None:
        super().log(step, metrics)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
