"""TensorBoard and MLflow as loggers (`logger=tensorboard`, `logger=mlflow`, or several at once with
`logger.also`): real runs of the tiny model, read back with TensorBoard's event reader and
MLflow's client, against the run's own metrics.jsonl; a resumed run continues its MLflow run."""

import json
import shutil

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cli import train
from conftest import make_cfg
from rlkit.refusals import ConfigError
from rlkit.session import run

TRAIN = ["steps=3", "eval.every=0", "checkpoint.every=1", "samples_every=1"]


def jsonl(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def same(points: list[tuple[int, float]], expected: list[tuple[int, float]], key: str) -> None:
    """The same steps, and the same values to float32 (TensorBoard keeps float32)."""
    assert [s for s, _ in points] == [s for s, _ in expected], key
    assert [v for _, v in points] == pytest.approx([v for _, v in expected], rel=1e-6), key


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "trackers-test")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read a file store
    return MlflowClient(uri)


def test_tensorboard_and_mlflow_at_once_hold_the_run_s_metrics_and_config(tmp_path, warm_cache, store):
    """From the command line (so the chosen options are Hydra's): wandb, TensorBoard and MLflow."""
    run_dir = tmp_path / "run"
    out = train(run_dir, warm_cache, *TRAIN, "logger=wandb", "logger.also=[tensorboard,mlflow]")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = jsonl(run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    for key in ("train/loss", "train/reward", "time/step"):
        same([(e.step, e.value) for e in events.Scalars(key)], logged(rows, key), key)
    assert "config/text_summary" in events.Tags()["tensors"] and "samples/text_summary" in events.Tags()["tensors"]
    run_id = (run_dir / "mlflow_run_id").read_text()
    flow = store.get_run(run_id)
    assert (
        flow.info.status == "FINISHED"
        and flow.info.experiment_id == store.get_experiment_by_name("trackers-test").experiment_id
    )
    for key in ("train/loss", "train/reward", "eval/accuracy"):
        same([(m.step, m.value) for m in store.get_metric_history(run_id, key)], logged(rows, key), key)
    assert flow.data.params["optim.lr"] == str(make_cfg(TRAIN).optim.lr)
    choices = json.loads((run_dir / "run.json").read_text())["choices"]
    assert choices["logger"] == "wandb" and {k: flow.data.tags[k] for k in choices} == {
        k: str(v) for k, v in choices.items()
    }
    assert (run_dir / "wandb").is_dir()  # wandb (offline) too


def test_a_resumed_run_continues_its_mlflow_run_and_tensorboard_keeps_one_value_a_step(tmp_path, warm_cache, store):
    """Stopped after step 3's metrics and before its checkpoint: the rerun resumes from step 2,
    logging step 3 again; MLflow holds one run whose last value at each step is the run's."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(make_cfg([*TRAIN, "logger=mlflow", "logger.also=[mlflow,tensorboard]"], warm_cache), str(straight))
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_000003"))
    run(make_cfg([*TRAIN, "logger=mlflow", "logger.also=[mlflow,tensorboard]"], warm_cache), str(resumed))
    assert (resumed / "mlflow_run_id").read_text() == (straight / "mlflow_run_id").read_text()
    history = store.get_metric_history((resumed / "mlflow_run_id").read_text(), "train/loss")
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    same(sorted(last.items()), logged(jsonl(resumed), "train/loss"), "train/loss")
    events = EventAccumulator(str(resumed / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]  # step 3's first value purged


def test_an_unknown_tracker_is_refused_and_one_that_cannot_start_is_named(tmp_path, warm_cache, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"logger.also: unknown tracker\(s\) \['neptune'\]"):
        run(make_cfg([*TRAIN, "logger.also=[neptune]"], warm_cache), str(tmp_path / "a"))
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # refused before the logger wrote anything
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    run(make_cfg(["steps=1", "eval.every=0", "logger=mlflow"], warm_cache), str(tmp_path / "b"))
    assert "rlkit: mlflow could not start" in capsys.readouterr().err
    assert [r["step"] for r in jsonl(tmp_path / "b")] == [0, 1]  # training went on
