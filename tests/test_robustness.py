"""Same seed, same numbers whatever ran before; runs that survive torn files, shared directories,
damaged checkpoints and buggy plugins; every bad input named (exit 2), signals during set-up."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import FAST, make_cfg
from helpers import SIGN_ONLY, write_plugin
from rlkit.analysis.compare import main as compare_main
from rlkit.config import ConfigError
from rlkit.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from rlkit.locks import RunDirLock
from rlkit.train import run
from test_reliability import GOOD, command, file_task, metrics, wait_for, write_jsonl


def test_same_seed_gives_the_same_metrics_whatever_filled_the_cache(tmp_path):
    run(make_cfg(["seed=0"], cache_dir=str(tmp_path / "empty")), str(tmp_path / "alone"))
    run(make_cfg(["seed=1"], cache_dir=str(tmp_path / "shared")), str(tmp_path / "first"))
    run(make_cfg(["seed=0"], cache_dir=str(tmp_path / "shared")), str(tmp_path / "after"))
    assert metrics(tmp_path / "alone") == metrics(tmp_path / "after")
    assert metrics(tmp_path / "first")[0] == metrics(tmp_path / "after")[0]  # both seeds start from one policy


@pytest.mark.slow
def test_a_parallel_sweep_on_an_empty_cache_warm_starts_once_and_every_job_uses_it(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit.train",
            "-m",
            "seed=0,1",
            *FAST,
            "steps=1",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            f"warm_start.cache_dir={tmp_path / 'cache'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    infos = [json.loads(p.read_text())["warm_start"] for p in sorted((tmp_path / "sweep").rglob("run.json"))]
    assert len(infos) == 2 and infos[0]["cache"] == infos[1]["cache"]
    assert sorted(i["trained"] for i in infos) == [False, True]  # one job trained it, the other waited and loaded it
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1
    starts = [metrics(p.parent)[0] for p in sorted((tmp_path / "sweep").rglob("metrics.jsonl"))]
    assert starts[0] == starts[1]


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_file_task_with_numeric_answers_trains(tmp_path, fmt, warm_cache):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(5) for b in range(5)]  # answers are ints
    if fmt == "csv":
        for name in ("train", "eval"):
            (tmp_path / f"{name}.csv").write_text(
                "prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows)
            )
        files = [
            "task=files",
            "task.format=csv",
            f"task.train_path={tmp_path / 'train.csv'}",
            f"task.eval_path={tmp_path / 'eval.csv'}",
        ]
    else:
        files = file_task(tmp_path, rows, rows[:4])
    summary = run(make_cfg(files + ["steps=1"], cache_dir=warm_cache), str(tmp_path / "run"))
    assert summary["steps"] == 1


def damage_state(ckpt):
    path = ckpt / "trainer_state.pt"
    path.write_bytes(path.read_bytes()[:100])


def remove_weights(ckpt):
    (ckpt / "policy" / "model.safetensors").unlink()


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


def test_a_run_directory_held_by_a_live_run_is_refused(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(ConfigError, match=r"is in use by a live run \(pid \d+\)"):
            run(make_cfg([]), str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_compare_keeps_the_last_of_repeated_steps_and_says_so(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text(json.dumps({"choices": {"algo": "grpo"}, "config": {}}))
    write_jsonl(
        tmp_path / "r" / "metrics.jsonl",
        [
            {"step": 0, "eval/accuracy": 0.1},
            {"step": 1, "eval/accuracy": 0.2},
            {"step": 0, "eval/accuracy": 0.3},
            {"step": 1, "eval/accuracy": 0.4},
        ],
    )
    (tmp_path / "r" / "summary.json").write_text("{}")
    assert compare_main([str(tmp_path), "--by", "algo"]) == 0
    out = capsys.readouterr()
    assert "has step 0 more than once" in out.err and "0.400" in out.out


def test_a_torn_last_metrics_line_is_dropped_on_resume_naming_the_file(tmp_path, capsys, warm_cache):
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/rew')
    run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path))
    assert f"{tmp_path / 'metrics.jsonl'} line 4 is not valid JSON" in capsys.readouterr().err
    assert [l["step"] for l in metrics(tmp_path)] == [0, 1, 2, 3]


def test_rerunning_a_finished_run_keeps_its_summary(tmp_path, capsys, warm_cache):
    first = run(make_cfg([], cache_dir=warm_cache), str(tmp_path))
    steps_time = sum(l["time/step"] for l in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]))
    assert first["wall_s"] > steps_time  # set-up, warm start and evaluations count too
    assert run(make_cfg([], cache_dir=warm_cache), str(tmp_path)) == first
    assert "had already finished at step 2" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text()) == first


@pytest.mark.parametrize(
    "shape, message",
    [
        ("n", r"returned advantages of shape \(16,\); expected a float tensor of shape \[N, Tc\] = \[16, 12\]"),
        ("n1", r"returned advantages of shape \(16, 1\)"),
        ("pg", r"returned advantages of shape \(4, 4\)"),
        ("raise", r"advantage=WrongShape raised on a rollout of 16 rows: IndexError: plugin bug"),
    ],
)
def test_a_plugin_estimator_with_a_bug_is_named_before_any_update(tmp_path, shape, message, warm_cache):
    cfg = make_cfg(
        [
            "++advantage._target_=helpers.WrongShape",
            f"++advantage.shape={shape}",
            "~advantage.std",
            "~advantage.eps",
            "~advantage.std_scope",
            "rollout.max_new_tokens=12",
            "loss.beta=0",
        ],
        cache_dir=warm_cache,
    )
    with pytest.raises(ConfigError, match=message):
        run(cfg, str(tmp_path))
    assert [l["step"] for l in metrics(tmp_path)] == [0] and not (tmp_path / "checkpoints").exists()


def cli(args, cwd, timeout=300, exe=(sys.executable, "-m", "rlkit.train")):
    return subprocess.run(
        [*exe, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "WANDB_MODE": "offline"},
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("advantage.bogus=1", "Could not override 'advantage.bogus'"),
        ("+loss.eps_hi=0.3", "loss.eps_hi is not an option of rlkit.losses.PPOClip (options: ['eps_low', 'eps_high'"),
        ("model.hidden_size=abc", "model.hidden_size='abc' must be of type int"),
        ("advantage=nope", "Could not find 'advantage/nope'"),
    ],
)
@pytest.mark.slow
def test_bad_input_exits_2_with_a_message_and_leaves_no_output_folder(tmp_path, override, message):
    out = cli([override, "steps=1", "warm_start.steps=0"], tmp_path)
    assert out.returncode == EXIT_BAD_INPUT and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_the_readme_plugin_example_runs_from_the_console_script(tmp_path):
    """`rlkit-train advantage=sign hydra.searchpath=[file://my_conf]` from the folder holding my_estimators/."""
    exe = shutil.which("rlkit-train")
    if exe is None:
        pytest.skip("rlkit-train is not installed")
    write_plugin(tmp_path, "my_estimators", SIGN_ONLY, "advantage", "sign", "_target_: my_estimators.SignOnly\n")
    out = cli(
        [
            "advantage=sign",
            "hydra.searchpath=[file://my_conf]",
            *FAST,
            "steps=1",
            "warm_start.steps=0",
            "hydra.run.dir=run",
        ],
        tmp_path,
        exe=(exe,),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rlkit warm start" not in out.stderr and "rlkit eval" in out.stderr  # progress bars
    assert metrics(tmp_path / "run")[1]["train/num_rows"] == 16


def test_characters_the_tokenizer_cannot_encode_are_named(tmp_path):
    from rlkit.models import TinyQwen2
    from rlkit.tasks.arithmetic import ALPHABET

    model, tok = TinyQwen2(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64).build(
        ALPHABET, 0
    )
    tok.save_pretrained(tmp_path / "hf")
    model.save_pretrained(tmp_path / "hf")
    files = file_task(tmp_path, GOOD, GOOD + [{"prompt": "1+é=", "answer": "1"}])
    with pytest.raises(
        ConfigError, match=r"task.eval row 2 \('1\+é='\) has characters the tokenizer cannot encode: \['é'\]"
    ):
        run(make_cfg(files + ["model=pretrained", f"model.path={tmp_path / 'hf'}"]), str(tmp_path / "run"))


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
