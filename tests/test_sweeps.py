"""Sweeps and comparison: Hydra multirun, launcher configs, wandb offline files, rlkit-compare."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import wandb
from hydra import compose, initialize_config_module
from matplotlib.image import imread

from cli import metrics, sweep
from conftest import make_cfg
from helpers import write_jsonl
from rlkit import sweeps
from rlkit.analysis.compare import main as compare_main
from rlkit.analysis.stats import mean_ci
from rlkit.exits import EXIT_BAD_INPUT
from rlkit.session import run
from wandb_files import read_records


@pytest.mark.slow
def test_multirun_over_two_variants_writes_two_run_directories(tmp_path, warm_cache):
    out = sweep(tmp_path / "sweep", warm_cache, "advantage=grpo,rloo", "seed=0", jobs=1)  # the default launcher
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted(p.parent for p in (tmp_path / "sweep").rglob("metrics.jsonl"))
    assert [p.name[:16] for p in runs] == ["0_advantage=grpo", "1_advantage=rloo"]  # named by overrides
    assert all(len(p.name) <= 98 for p in runs)  # long override lists are cut with a hash
    for p, adv in zip(runs, ("grpo", "rloo")):
        assert json.loads((p / "run.json").read_text())["choices"]["advantage"] == adv
        assert [json.loads(l)["step"] for l in (p / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def job_folders(sweep_dir) -> dict:
    """Job number -> folder of a sweep."""
    return {int(p.name.split("_")[0]): p for p in sweep_dir.iterdir() if p.is_dir()}


@pytest.mark.slow
def test_a_sweep_runs_every_job_records_each_failure_and_compare_names_them(tmp_path, warm_cache):
    crashing = "task._target_=helpers.CrashingArithmetic,rlkit.tasks.arithmetic.Arithmetic"
    out = sweep(tmp_path / "sweep", warm_cache, "steps=3", crashing, "optim.lr=-1,1e-4")  # joblib, 2 at a time
    assert out.returncode == 1, out.stderr[-3000:]  # its jobs failed in different ways (2 and 1)
    assert "rlkit: 3 of 4 jobs failed, the others ran: job 0 in" in out.stderr
    records = {r["job"]: r for _, r in sweeps.failures(tmp_path / "sweep")}
    assert {j: r["exit_code"] for j, r in records.items()} == {0: 2, 1: 1, 2: 2}
    assert records[0]["error"] == records[2]["error"] == "optim.lr must be > 0, got -1.0"
    assert records[1]["error"] == "RuntimeError: task bug in step_metrics" and "Traceback" in out.stderr
    folders = job_folders(tmp_path / "sweep")
    assert [l["step"] for l in metrics(folders[1])] == [0, 1]  # the crashed job keeps what it logged
    assert [l["step"] for l in metrics(folders[3])] == [0, 1, 2, 3] and (folders[3] / "summary.json").exists()
    shutil.rmtree(folders[2])
    assert compare_main([str(tmp_path / "sweep"), "--by", "task._target_", "--include-unfinished"]) == 0
    md = (tmp_path / "sweep" / "compare" / "compare.md").read_text()
    assert f"job 0 ({folders[0]}) failed with exit code 2: optim.lr must be > 0, got -1.0" in md
    assert f"job 1 ({folders[1]}) failed with exit code 1: RuntimeError: task bug in step_metrics" in md
    assert re.search(r"job 2 of the sweep \([^)]*optim.lr=-1[^)]*\) left no run record", md)
    assert "job 3" not in md


@pytest.mark.slow
def test_a_failed_job_of_a_sweep_on_the_basic_launcher_keeps_its_folder_and_the_next_job_runs(tmp_path, warm_cache):
    out = sweep(tmp_path / "sweep", warm_cache, "optim.lr=-1,1e-4", jobs=1)
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-3000:]  # every failure was bad input
    assert "rlkit: 1 of 2 jobs failed, the others ran: job 0 in" in out.stderr
    folders = job_folders(tmp_path / "sweep")
    assert json.loads((folders[0] / "failed.json").read_text())["exit_code"] == EXIT_BAD_INPUT
    assert (folders[0] / ".hydra" / "overrides.yaml").exists()  # the job's own record of what it was
    assert (folders[1] / "summary.json").exists() and not (folders[1] / "failed.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])  # the basic launcher, and joblib two at a time
def test_a_job_that_does_not_compose_fails_alone_and_the_sweep_runs_the_others(tmp_path, warm_cache, jobs):
    """An unknown option and a value of the wrong type once stopped the whole multirun before any
    job ran (Hydra's basic sweeper composes every job first); now each fails alone, recorded in its
    own folder as bad input, and the jobs between them run with their own numbers."""
    out = sweep(tmp_path / "sweep", warm_cache, "advantage=nope,grpo,rloo", "steps=1,abc", jobs=jobs)
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-3000:]
    assert "rlkit: 4 of 6 jobs failed, the others ran: job 0 in" in out.stderr
    records = {r["job"]: r for _, r in sweeps.failures(tmp_path / "sweep")}
    # Hydra's order: steps=1 with nope, grpo, rloo (jobs 0-2), then steps=abc with each (jobs 3-5)
    assert sorted(records) == [0, 3, 4, 5] and {r["exit_code"] for r in records.values()} == {EXIT_BAD_INPUT}
    assert "Could not find 'advantage/nope'" in records[0]["error"] and "abc" in records[4]["error"]
    folders = job_folders(tmp_path / "sweep")
    for job, advantage in ((1, "grpo"), (2, "rloo")):  # ran, under their own sweep numbers
        assert json.loads((folders[job] / "run.json").read_text())["choices"]["advantage"] == advantage
        assert (folders[job] / "summary.json").exists()
    assert "advantage=rloo" in sweeps.jobs(tmp_path / "sweep")[2]


@pytest.mark.parametrize(
    "launcher, target",
    [
        ("joblib", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
        ("submitit_slurm", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
        ("slurm_ddp", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
    ],
)
def test_launcher_configs_compose(launcher, target):
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_ == target
    assert launcher != "slurm_ddp" or cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node == 8


def test_experiment_compare_estimators_composes_and_runs_one_step(tmp_path, warm_cache):
    cfg = make_cfg(["+experiment=compare_estimators", "steps=1"], cache_dir=warm_cache)
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        hcfg = compose("config", overrides=["+experiment=compare_estimators"], return_hydra_config=True)
    assert hcfg.hydra.sweeper.params.advantage == "grpo,dr_grpo,rloo,gae" and hcfg.eval.every == 20
    assert "joblib" in hcfg.hydra.launcher._target_
    assert run(cfg, str(tmp_path / "run"))["steps"] == 1


def test_offline_wandb_run_holds_config_history_and_samples(tmp_path, monkeypatch, warm_cache):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = make_cfg(["logger=wandb", "steps=3", "samples_every=2", "logger.group=study"], cache_dir=warm_cache)
    run(cfg, str(tmp_path), {"choices": {"algo": "grpo", "advantage": "grpo"}})
    wandb.teardown()  # wandb's service closes the .wandb file up to ~0.1 s after run.finish(); wait for it
    [data] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    records = read_records(data)
    updates = [
        r.run.config.update if r.HasField("run") else r.config.update
        for r in records
        if r.HasField("run") or r.HasField("config")
    ]
    config = {i.key: json.loads(i.value_json) for u in updates for i in u}
    assert config["advantage"] == "grpo" and config["loss.beta"] == 0.04 and config["rollout.group_size"] == 4
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    steps = [h["_step"] for h in history]
    assert steps == [0, 1, 2, 3]
    local = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["train/reward"] for h in history[1:]] == pytest.approx([l["train/reward"] for l in local[1:]])
    assert [h["samples/nrows"] for h in history if "samples/nrows" in h] == [8, 8]  # steps 1 and 2, 4 groups x 2
    [info] = [r.run for r in records if r.HasField("run")][:1]
    assert info.run_group == "study" and "advantage:grpo" in list(info.tags)


def test_wandb_failure_does_not_stop_training(tmp_path, capsys, warm_cache):
    cfg = make_cfg(["logger=wandb", "logger.mode=bogus", "steps=1"], cache_dir=warm_cache)
    assert run(cfg, str(tmp_path))["steps"] == 1
    assert capsys.readouterr().err.count("wandb could not start") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def write_run(root, name, choices, series, wall):
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"choices": choices, "config": {"seed": 0, "loss": {"beta": 0.04}}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/accuracy": v}) + "\n" for s, v in series))
    (d / "summary.json").write_text(json.dumps({"wall_s": wall}))


def test_mean_ci_by_hand():
    # mean 0.6, sample sd 0.1, t(2) = 4.3027 -> 4.3027 * 0.1 / sqrt(3) = 0.248417
    m, ci = mean_ci([0.5, 0.7, 0.6])
    assert m == pytest.approx(0.6) and ci == pytest.approx(0.248417, abs=1e-5)
    assert math.isnan(mean_ci([0.3])[1])


def test_compare_tables_and_plots(tmp_path, capsys):
    write_run(tmp_path, "a0", {"algo": "grpo"}, [(0, 0.3), (10, 0.5), (20, 0.5)], 100)
    write_run(tmp_path, "a1", {"algo": "grpo"}, [(0, 0.3), (10, 0.6), (20, 0.7)], 110)
    write_run(tmp_path, "a2", {"algo": "grpo"}, [(0, 0.3), (10, 0.4), (20, 0.6)], 120)
    write_run(tmp_path, "b0", {"algo": "rloo"}, [(0, 0.3), (10, 0.35), (20, 0.45)], 90)
    assert compare_main([str(tmp_path), "--by", "algo", "--metric", "eval/accuracy", "--threshold", "0.5"]) == 0
    md = (tmp_path / "compare" / "compare.md").read_text()
    # grpo final [0.5, 0.7, 0.6] -> 0.600 ± 0.248; best [0.5, 0.7, 0.6] same; steps to 0.5: [10, 10, 20]
    # -> mean 13.333, sd 5.7735, ci 4.302653*5.7735/sqrt(3) = 14.342; wall [100, 110, 120] -> 110 ± 24.841
    assert "| grpo | 3 | 0.600 ± 0.248 | 0.600 ± 0.248 | 13.333 ± 14.342 (3/3 runs) | 110.000 ± 24.841 |" in md
    assert "| rloo | 1 | 0.450 | 0.450 | never (0/1) | 90.000 |" in md
    png = tmp_path / "compare" / "eval_accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and imread(png).shape[2] in (3, 4)
    assert "grpo" in capsys.readouterr().out


def test_a_plot_has_a_title_and_whole_steps_on_its_step_axis(tmp_path):
    """Three evaluations over 2 steps drew ticks at 0.25-step intervals and no title."""
    from rlkit.analysis.compare import figure, group_runs
    from rlkit.analysis.runs import load_runs

    write_run(tmp_path, "a0", {"algo": "grpo"}, [(0, 0.3), (1, 0.5), (2, 0.5)], 100)
    write_run(tmp_path, "b0", {"algo": "rloo"}, [(0, 0.3), (1, 0.35), (2, 0.45)], 90)
    fig = figure(group_runs(load_runs(tmp_path), ["algo"]), ["algo"], "eval/accuracy")
    ticks = [t for t in fig.axes[0].get_xticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert fig._suptitle.get_text() == "eval/accuracy by algo (mean, 95% band over runs)"


def test_compare_groups_by_config_keys_and_names_missing_ones(tmp_path, capsys):
    write_run(tmp_path, "a0", {"algo": "grpo"}, [(0, 0.3), (10, 0.5)], 10)
    assert compare_main([str(tmp_path), "--by", "loss.beta", "algo"]) == 0
    assert "| 0.04 | grpo | 1 |" in (tmp_path / "compare" / "compare.md").read_text()
    with pytest.raises(SystemExit):
        compare_main([str(tmp_path), "--by", "advantage"])
    assert re.search("has no key 'advantage'.*algo", capsys.readouterr().err)


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch, warm_cache):

    monkeypatch.setenv("WANDB_MODE", "offline")
    ids = []
    for steps in (2, 4):
        run(
            make_cfg(["logger=wandb", f"steps={steps}", "checkpoint.keep=5"], cache_dir=warm_cache),
            str(tmp_path / "run"),
        )
        state = torch.load(
            tmp_path / "run" / "checkpoints" / f"step_{steps:06d}" / "trainer_state.pt", weights_only=False
        )
        ids.append(state["run_id"])
    assert ids[0] and ids[0] == ids[1]  # the resumed process logged to the same wandb run
    # offline-run-<date>_<time>-<id>, plus "-1" when both sessions started within the same second
    names = [p.name for p in (tmp_path / "run" / "wandb").glob("offline-run-*")]
    assert {re.match(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)", n)[1] for n in names} == {ids[0]}


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


def test_compare_names_unreadable_run_records_and_bad_metrics_records_and_goes_on(tmp_path, capsys):
    write_run(tmp_path, "good", {"algo": "grpo"}, [(0, 0.1), (1, 0.5)], 3.0)
    write_run(tmp_path, "torn", {"algo": "grpo"}, [(0, 0.2), (1, 0.6)], 3.0)
    (tmp_path / "torn" / "run.json").write_text('{"choices": {"alg')
    write_run(tmp_path, "list", {"algo": "grpo"}, [(0, 0.2)], 3.0)
    (tmp_path / "list" / "run.json").write_text("[1, 2]")
    with (tmp_path / "good" / "metrics.jsonl").open("a") as f:
        f.write('{"eval/accuracy": 0.9}\n[1, 2]\n{"step": "2", "eval/accuracy": 0.9}\n')
    assert compare_main([str(tmp_path), "--by", "algo"]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'torn' / 'run.json'} cannot be read (JSONDecodeError" in err
    assert f"{tmp_path / 'list' / 'run.json'} cannot be read (ValueError: not a run record" in err
    assert f"{tmp_path / 'good' / 'metrics.jsonl'} has 3 records that are not objects with an integer step" in err
    assert "| grpo | 1 | 0.500 |" in (tmp_path / "compare" / "compare.md").read_text()


def test_a_corrupt_summary_is_named_as_itself_and_its_run_is_kept(tmp_path, capsys):
    """summary.json and run.json were read in one `try`, so a torn summary was reported as an
    unreadable run.json and the whole run left out."""
    write_run(tmp_path, "a", {"algo": "grpo"}, [(0, 0.1), (1, 0.5)], 3.0)
    write_run(tmp_path, "b", {"algo": "grpo"}, [(0, 0.2), (1, 0.7)], 3.0)
    (tmp_path / "b" / "summary.json").write_text('{"wall_s": 3')
    assert compare_main([str(tmp_path), "--by", "algo"]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'b' / 'summary.json'} cannot be read (JSONDecodeError" in err and "run.json" not in err
    assert "| grpo | 2 | 0.600 ± " in (tmp_path / "compare" / "compare.md").read_text()  # both runs, b kept


def test_compare_refuses_a_metric_nobody_logged(tmp_path, capsys, warm_cache):
    from rlkit.analysis.compare import main

    run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path / "run"))
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "run"), "--metric", "eval/nobody", "--baseline", "grpo"])
    assert e.value.code == 2 and "--metric eval/nobody: no run logged it" in capsys.readouterr().err
    assert not (tmp_path / "run" / "compare").exists()


def test_a_script_composes_the_config_before_anything_imports_rlkit(tmp_path):
    """Hydra's plugin scan executes the installed sweeper module without registering it: a fresh
    process that composes first (a user's script, a benchmark worker) must not crash on it."""
    import subprocess
    import sys

    code = (
        "from hydra import compose, initialize_config_module\n"
        "with initialize_config_module(config_module='rlkit.conf', version_base=None):\n"
        "    print(compose(config_name='config', overrides=['algo=dr_grpo']).advantage._target_)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "rlkit.advantages.DrGRPO"


@pytest.mark.slow
@pytest.mark.parametrize("group", ["advantage", "loss"])
def test_a_multirun_over_every_option_of_a_group_runs_each_for_two_steps(group, tmp_path, warm_cache):
    """`rlkit-train -m advantage=<every option>` (and `loss=`), two steps each on the tiny model,
    two jobs at a time: every job finishes and logs an update."""
    names = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / group).glob("*.yaml"))
    out = sweep(tmp_path / "sweep", warm_cache, f"{group}={','.join(names)}", "eval.every=0", "checkpoint.every=0")
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {
        json.loads((p / "run.json").read_text())["choices"][group]: p for p in job_folders(tmp_path / "sweep").values()
    }
    assert sorted(runs) == names
    for name, folder in runs.items():
        lines = metrics(folder)
        assert [l["step"] for l in lines] == [0, 1, 2] and all("train/loss" in l for l in lines[1:]), name
