"""Metric sinks. `metrics.jsonl` in the run directory is the source of truth; wandb and the
trackers of `rlkit.trackers` (TensorBoard, MLflow; `logger.also`) mirror it."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from rlkit import atomic, trackers


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def present(metrics: dict) -> dict:
    """The metrics that have a value: a statistic of an empty subset is None and is not logged."""
    return {k: v for k, v in metrics.items() if v is not None}


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log; a line cut short by a kill mid-write is dropped, and said."""
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line)) if line.strip() else None
        except json.JSONDecodeError:
            print(f"rlkit: {path} line {n} is not valid JSON (cut short by a kill?); dropped", file=sys.stderr)
    return records


def _truncate(path: Path, step: int) -> None:
    """Drop records past `step` (a resumed run rewrites them); the file is replaced whole, so a kill
    during the rewrite leaves either the old lines or the kept ones."""
    if path.exists():
        keep = [r for r in read_jsonl(path) if r.get("step", step + 1) <= step]
        atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


class JsonlLogger:
    """One JSON line per step in `<run_dir>/metrics.jsonl`, sample completions in `samples.jsonl`,
    each mirrored to the trackers named in `also` (`tensorboard`, `mlflow`: `rlkit.trackers`).
    `run_info` holds the chosen config options (`choices`) and, in a sweep, the sweep's name."""

    def __init__(
        self,
        run_dir: str,
        run_config: dict,
        resume_step: int = 0,
        run_id: str | None = None,
        run_info: dict | None = None,
        also: list | tuple = (),
    ):
        trackers.check(also)  # a wrong name is refused before any file is touched
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for p in (self.path, self.samples_path):
            if resume_step:
                _truncate(p, resume_step)
            else:
                p.write_text("")
        self.run_id = None
        self.trackers = trackers.start(list(also), run_dir, flatten(run_config), resume_step, run_info or {})

    def log(self, step: int, metrics: dict) -> None:
        clean = {
            k: (v if isinstance(v, (int, str)) or math.isfinite(v) else str(v)) for k, v in present(metrics).items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        for t in self.trackers:
            t.log(step, present(metrics))

    def log_samples(self, step: int, samples: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            f.write(json.dumps({"step": step, "samples": samples}) + "\n")
        for t in self.trackers:
            t.log_samples(step, samples)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()


class NullLogger:
    """What ranks other than 0 log to: nothing."""

    run_id = None

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_samples(self, step: int, samples: list[dict]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(JsonlLogger):
    """Also logs to wandb: offline unless WANDB_MODE or `mode` says otherwise. The config goes up
    flattened with the chosen option of each group (`algo`, `advantage`, ...) as its own key; in a
    sweep the group defaults to the sweep's name and the run's name to its overrides; tags name
    the chosen options. If wandb cannot start, training goes on and says so once."""

    def __init__(
        self,
        run_dir: str,
        run_config: dict,
        resume_step: int = 0,
        project: str = "rlkit",
        mode: str | None = None,
        group: str | None = None,
        tags: list | None = None,
        name: str | None = None,
        run_id: str | None = None,
        run_info: dict | None = None,
        also: list | tuple = (),
    ):
        super().__init__(run_dir, run_config, resume_step, run_info=run_info, also=also)
        info = run_info or {}
        choices = info.get("choices", {})
        self.run = None
        try:
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb = wandb
            self.run = wandb.init(
                project=project,
                dir=run_dir,
                config={**flatten(run_config), **choices},
                mode=mode or os.environ.get("WANDB_MODE", "offline"),
                group=group or info.get("sweep"),
                name=name or info.get("name"),
                tags=list(tags or []) + [f"{k}:{v}" for k, v in choices.items()],
                id=run_id,
                resume="allow" if run_id else None,
                reinit="finish_previous",
            )
            self.run_id = self.run.id
        except Exception as e:  # noqa: BLE001 - any wandb failure must not stop training
            print(
                f"rlkit: wandb could not start ({type(e).__name__}: {e}); logging to {self.path} only", file=sys.stderr
            )

    def log(self, step: int, metrics: dict) -> None:
        super().log(step, metrics)
        if self.run is not None:
            self.run.log(present(metrics), step=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        super().log_samples(step, samples)
        if self.run is not None and samples:
            cols = list(samples[0])
            self.run.log(
                {"samples": self.wandb.Table(columns=cols, data=[[s[c] for c in cols] for s in samples])}, step=step
            )

    def finish(self) -> None:
        super().finish()
        if self.run is not None:
            self.run.finish()
