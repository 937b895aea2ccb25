"""Experiment trackers that mirror `metrics.jsonl` (a logger's `also: [tensorboard, mlflow]`):
TensorBoard event files in the run directory and an MLflow run in a tracking store. Each gets the
same metrics at the same steps and the run's flattened config; one that cannot start is named once
and training goes on with the others. Each takes the run's config flattened (`optim.lr`: value)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from rlkit.refusals import require


def numbers(metrics: dict) -> dict:
    """The metrics a tracker can plot: finite numbers (the JSON-lines log keeps everything)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoard:
    """Event files under `<run_dir>/tensorboard/`: each metric a scalar at its step, the config
    and the chosen options as text at step 0, sample completions as a text table. A resumed run
    purges the events logged after its checkpoint, as the JSON-lines log drops them."""

    def __init__(self, run_dir: str, run_config: dict, resume_step: int, run_info: dict):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step else None
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)
        if not resume_step:
            config = json.dumps({**run_config, "choices": run_info.get("choices", {})}, indent=1, default=str)
            self.writer.add_text("config", f"```\n{config}\n```", 0)

    def log(self, step: int, metrics: dict) -> None:
        for k, v in numbers(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if samples:
            cols = list(samples[0])
            rows = [" | ".join(str(s[c]).replace("\n", " ") for c in cols) for s in samples]
            self.writer.add_text("samples", "\n".join([" | ".join(cols), " | ".join("---" for _ in cols), *rows]), step)

    def finish(self) -> None:
        self.writer.close()


class MLflow:
    """An MLflow run in the tracking store that `MLFLOW_TRACKING_URI` names (without it, the local
    file store `./mlruns`, which MLflow 3 keeps readable but asks to opt into:
    `MLFLOW_ALLOW_FILE_STORE`, set here for it), in the experiment `MLFLOW_EXPERIMENT_NAME`
    (default `rlkit`): the
    flattened config as parameters, the chosen options as tags, each metric at its step. The run's
    id is kept in `<run_dir>/mlflow_run_id`, so a resumed run continues the same MLflow run (whose
    metric history then holds the steps after the checkpoint twice; the later value is the one the
    run's metrics.jsonl keeps)."""

    def __init__(self, run_dir: str, run_config: dict, resume_step: int, run_info: dict):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:./mlruns"
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        id_file = Path(run_dir) / "mlflow_run_id"
        if resume_step and id_file.exists():
            self.run_id = id_file.read_text().strip()
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlkit")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        tags = {k: str(v) for k, v in run_info.get("choices", {}).items()}
        run = self.client.create_run(experiment, run_name=run_info.get("name"), tags=tags)
        self.run_id = run.info.run_id
        params = {k: str(v)[:500] for k, v in run_config.items()}
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in list(params.items())[i : i + 100]])
        id_file.write_text(self.run_id)

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numbers(metrics).items()])

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if samples:
            self.client.log_text(self.run_id, json.dumps(samples, indent=1), f"samples/step_{step:06d}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value)


TRACKERS = {"tensorboard": TensorBoard, "mlflow": MLflow}


def check(names) -> None:
    """Each name one of TRACKERS (before the logger writes anything)."""
    unknown = [n for n in names if n not in TRACKERS]
    require(not unknown, f"logger.also: unknown tracker(s) {unknown}; known: {sorted(TRACKERS)}")


def start(names, run_dir: str, run_config: dict, resume_step: int, run_info: dict) -> list:
    """The trackers `names` (checked by `check`); one that cannot start is named, and left out."""
    out = []
    for name in names:
        try:
            out.append(TRACKERS[name](run_dir, run_config, resume_step, run_info))
        except Exception as e:  # noqa: BLE001 - a tracker that cannot start must not stop training
            print(
                f"rlkit: {name} could not start ({type(e).__name__}: {e}); training goes on without it", file=sys.stderr
            )
    return out
