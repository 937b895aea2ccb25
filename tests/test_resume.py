"""Stops and resumes: kill -9 and SIGTERM mid-run, signals during set-up, damaged, hostile or
foreign checkpoints, torn metrics files, and starting over in a used directory. A resumed run gives
the uninterrupted run's numbers and nothing of an earlier run is lost."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cli import TESTS, command, metrics, train, wait_for
from conftest import make_cfg
from rlkit import atomic, checkpoint
from rlkit.checkpoint import check_resume
from rlkit.exits import EXIT_PREEMPTED
from rlkit.refusals import ConfigError
from rlkit.rundir import RunDirLock
from rlkit.session import run
from rlkit.sinks import _truncate


def damage_state(ckpt):
    path = ckpt / "trainer_state.pt"
    path.write_bytes(path.read_bytes()[:100])


def remove_weights(ckpt):
    (ckpt / "policy" / "model.safetensors").unlink()


class Payload:
    """What an attacker puts in trainer_state.pt: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


MULTI_TURN = ["++environment._target_=helpers.Echo", "++environment.max_turns=3", "rollout.max_new_tokens=24"]


@pytest.mark.slow
@pytest.mark.parametrize("episodes", [[], MULTI_TURN], ids=["single_turn", "multi_turn"])
def test_kill_9_then_resume_gives_the_uninterrupted_metrics(tmp_path, warm_cache, episodes):
    args = ["steps=14", "checkpoint.every=2", "eval.every=3", *episodes]
    run(make_cfg(args, cache_dir=warm_cache), str(tmp_path / "ref"))  # uninterrupted, in this process: the same numbers
    env = {**os.environ, "PYTHONPATH": TESTS}  # the plugin environment importable, as in the test's process
    proc = subprocess.Popen(command(tmp_path / "run", warm_cache, *args), stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: (tmp_path / "run" / "checkpoints" / "step_000004").exists(), proc)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    partial = metrics(tmp_path / "run")
    assert partial[-1]["step"] < 14
    again = train(tmp_path / "run", warm_cache, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    assert metrics(tmp_path / "run") == metrics(tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # SIGHUP: the terminal or ssh session closed
def test_sigterm_writes_a_loadable_checkpoint_and_exits_distinctly(tmp_path, warm_cache, sig):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        command(run_dir, warm_cache, "steps=200", "checkpoint.every=0", "eval.every=0"),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) > 3,
        proc,
    )
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED
    err = proc.stderr.read()
    assert f"stopped by {sig.name} after step" in err and "Traceback" not in err
    last = metrics(run_dir)[-1]["step"]
    ckpt = run_dir / "checkpoints" / f"step_{last:06d}"
    assert AutoModelForCausalLM.from_pretrained(ckpt / "policy") is not None
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == last


@pytest.mark.slow
@pytest.mark.parametrize("sig, phase", [(signal.SIGTERM, "warm start"), (signal.SIGINT, "eval")])
def test_a_signal_during_set_up_exits_75_with_a_message(tmp_path, sig, phase):
    cache = tmp_path / "cache"
    extra = (
        ["warm_start.steps=20000"]
        if phase == "warm start"
        else ["warm_start.steps=5", "task.max_terms=3", "task.n_eval=900", "eval.batch_size=4"]
    )
    proc = subprocess.Popen(command(tmp_path / "run", cache, *extra), stderr=subprocess.PIPE, text=True)
    if phase == "warm start":
        wait_for(lambda: cache.exists() and any(p.suffix == ".lock" for p in cache.rglob("*")), proc)
    else:
        wait_for(lambda: cache.exists() and any(p.name == "weights.pt" for p in cache.rglob("*")), proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED
    err = proc.stderr.read()
    assert f"stopped by {sig.name}" in err and "Traceback" not in err
    if phase == "warm start":
        assert "during the warm start; nothing was cached" in err
        assert not [p for p in cache.iterdir() if p.is_dir()]


@pytest.mark.parametrize("damage", [damage_state, remove_weights])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_resumes(tmp_path, capsys, damage, warm_cache):
    run(make_cfg(["steps=3", "checkpoint.keep=3"], cache_dir=warm_cache), str(tmp_path))
    damage(tmp_path / "checkpoints" / "step_000003")
    capsys.readouterr()
    run(make_cfg(["steps=4", "checkpoint.keep=3"], cache_dir=warm_cache), str(tmp_path))
    err = capsys.readouterr().err
    assert "checkpoint" in err and "step_000003 is damaged" in err and "resuming from" in err and "step_000002" in err
    assert [l["step"] for l in metrics(tmp_path)] == [0, 1, 2, 3, 4]


def test_no_intact_checkpoint_is_refused_rather_than_starting_over(tmp_path, warm_cache):
    run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path))
    damage_state(tmp_path / "checkpoints" / "step_000001")
    with pytest.raises(ConfigError, match="no intact checkpoint .* checkpoint.resume=false"):
        run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path))
    assert [l["step"] for l in metrics(tmp_path)] == [0, 1]  # nothing lost


def test_a_trainer_state_that_would_run_code_is_refused_and_runs_nothing(tmp_path, warm_cache):
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    state = checkpoint.load_state(ckpt)  # a real state loads safely (RNG states are plain data)
    marker = tmp_path / "pwned"
    torch.save({**state, "sampler": Payload(marker)}, ckpt / "trainer_state.pt")
    atomic.write_manifest(ckpt)  # the attacker recomputes the checksums too
    with pytest.raises(
        ConfigError,
        match=r"trainer_state.pt holds objects other than tensors.*it names posix.system"
        r".*refusing",
    ) as e:
        run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path / "run"))
    assert not marker.exists()
    assert "weights_only" not in str(e.value) and "succeed" not in str(e.value)  # no advice to load it unsafely


def test_a_pickled_weight_file_in_a_checkpoint_is_refused_by_name_and_runs_nothing(tmp_path, warm_cache):
    """policy/pytorch_model.bin in place of the safetensors, its pickle running a command: refused
    with exit-2's ConfigError naming the file, without torch's advice to load it unsafely."""
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    weights = ckpt / "policy" / "model.safetensors"
    from safetensors.torch import load_file

    marker = tmp_path / "pwned"
    torch.save({**load_file(str(weights)), "payload": Payload(marker)}, ckpt / "policy" / "pytorch_model.bin")
    weights.unlink()
    atomic.write_manifest(ckpt)  # the attacker recomputes the checksums too
    with pytest.raises(ConfigError, match=r"holds a pickled weight file .*pytorch_model.bin.*refusing") as e:
        run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path / "run"))
    assert not marker.exists()
    assert "weights_only" not in str(e.value) and "succeed" not in str(e.value)


def test_a_checkpoint_with_numpy_rng_state_from_older_versions_still_resumes(tmp_path, warm_cache):
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    state = checkpoint.load_state(ckpt)
    old = [{**r, "numpy": np.random.get_state()} for r in state["rng_ranks"]]  # as earlier versions wrote it
    torch.save({**state, "rng_ranks": old}, ckpt / "trainer_state.pt")
    atomic.write_manifest(ckpt)
    assert run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path / "run"))["steps"] == 3


def test_a_checkpoint_resumes_only_under_the_same_parallel_setting():
    with pytest.raises(ConfigError, match="written with different parallel"):
        check_resume({"parallel": "replicate", "seed": 0}, {"parallel": "shard", "seed": 0}, "ckpt")


def test_a_torn_last_metrics_line_is_dropped_on_resume_naming_the_file(tmp_path, capsys, warm_cache):
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/rew')
    run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path))
    assert f"{tmp_path / 'metrics.jsonl'} line 4 is not valid JSON" in capsys.readouterr().err
    assert [l["step"] for l in metrics(tmp_path)] == [0, 1, 2, 3]


def test_the_resume_rewrite_of_metrics_replaces_the_file_instead_of_writing_into_it(tmp_path):
    """A hard link sees every write into the file's own bytes: after the rewrite it must still hold
    the old lines (the new ones went to a new file renamed over the name), so a kill mid-rewrite
    leaves one whole version or the other."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(50)))
    os.link(path, tmp_path / "link")
    _truncate(path, 9)
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == list(range(10))
    assert len((tmp_path / "link").read_text().splitlines()) == 50


def test_a_kill_during_the_resume_rewrite_loses_no_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = "".join(json.dumps({"step": s, "pad": "x" * 200}) + "\n" for s in range(80_000))
    for delay in (0.2, 0.5, 0.8):
        path.write_text(lines)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from rlkit.sinks import _truncate; from pathlib import Path; _truncate(Path({str(path)!r}), 39_999)",
            ]
        )
        time.sleep(delay)
        proc.kill()
        proc.wait()
        kept = len(path.read_text().splitlines())
        assert kept in (80_000, 40_000), (delay, kept)


def test_rerunning_a_finished_run_keeps_its_summary(tmp_path, capsys, warm_cache):
    first = run(make_cfg([], cache_dir=warm_cache), str(tmp_path))
    steps_time = sum(l["time/step"] for l in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]))
    assert first["wall_s"] > steps_time  # set-up, warm start and evaluations count too
    assert run(make_cfg([], cache_dir=warm_cache), str(tmp_path)) == first
    assert "had already finished at step 2" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text()) == first


def test_a_run_directory_held_by_a_live_run_is_refused(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(ConfigError, match=r"is in use by a live run \(pid \d+\)"):
            run(make_cfg([]), str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_starting_over_moves_the_older_run_aside_and_keeps_every_new_checkpoint(tmp_path, capsys, warm_cache):
    run(make_cfg(["steps=4"], cache_dir=warm_cache), str(tmp_path / "run"))
    old_metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    run(
        make_cfg(["steps=2", "checkpoint.resume=false", "checkpoint.keep=5"], cache_dir=warm_cache),
        str(tmp_path / "run"),
    )
    assert "the earlier run's files" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert [l["step"] for l in metrics(tmp_path / "run")] == [0, 1, 2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    (previous,) = (tmp_path / "run" / "previous_runs").iterdir()
    assert (previous / "metrics.jsonl").read_text() == old_metrics
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    # resuming the new run finds the new run's checkpoint, not the older run's step 4
    assert run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path / "run"))["steps"] == 3
    assert [l["step"] for l in metrics(tmp_path / "run")] == [0, 1, 2, 3]


@pytest.mark.slow
def test_starting_over_moves_the_earlier_runs_hydra_record_with_it(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    first = train(run_dir, warm_cache, "steps=1", "seed=3")
    assert first.returncode == 0, first.stderr[-3000:]
    earlier = {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()}
    assert "seed=3" in earlier["overrides.yaml"]
    again = train(run_dir, warm_cache, "steps=1", "seed=4", "checkpoint.resume=false")
    assert again.returncode == 0, again.stderr[-3000:]
    (previous,) = (run_dir / "previous_runs").iterdir()
    assert {p.name: p.read_text() for p in (previous / ".hydra").iterdir()} == earlier
    assert "seed=4" in (run_dir / ".hydra" / "overrides.yaml").read_text()
