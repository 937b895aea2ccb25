"""Attacks on purpose: hostile checkpoints, a full or read-only disk, an older run in the directory,
scorers that hang or time out, bad weights, models and data. Each test fails on a build that lacks
the guard it names."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from conftest import make_cfg
from rlkit import checkpoint
from rlkit.checkpoint import check_resume
from rlkit.config import ConfigError
from rlkit.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_STORAGE
from rlkit.sinks import _truncate
from rlkit.tasks.base import TaskError
from rlkit.train import run
from test_reliability import command, metrics, wait_for

TESTS = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])


def cli(run_dir, cache, *extra, env=None):
    return subprocess.run(
        command(run_dir, cache, *extra),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": TESTS, **(env or {})},
    )


class Payload:
    """What an attacker puts in trainer_state.pt: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_trainer_state_that_would_run_code_is_refused_and_runs_nothing(tmp_path, warm_cache):
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    state = checkpoint.load_state(ckpt)  # a real state loads safely (RNG states are plain data)
    marker = tmp_path / "pwned"
    torch.save({**state, "sampler": Payload(marker)}, ckpt / "trainer_state.pt")
    checkpoint.write_manifest(ckpt)  # the attacker recomputes the checksums too
    with pytest.raises(
        ConfigError,
        match=r"trainer_state.pt holds objects other than tensors.*it names posix.system"
        r".*refusing",
    ) as e:
        run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path / "run"))
    assert not marker.exists()
    assert "weights_only" not in str(e.value) and "succeed" not in str(e.value)  # no advice to load it unsafely


def test_a_checkpoint_with_numpy_rng_state_from_older_versions_still_resumes(tmp_path, warm_cache):
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    state = checkpoint.load_state(ckpt)
    old = [{**r, "numpy": np.random.get_state()} for r in state["rng_ranks"]]  # as earlier versions wrote it
    torch.save({**state, "rng_ranks": old}, ckpt / "trainer_state.pt")
    checkpoint.write_manifest(ckpt)
    assert run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path / "run"))["steps"] == 3


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


def test_a_math_verifier_timeout_scores_zero_and_is_counted(tmp_path):
    from rlkit.tasks.math import Math

    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 5"}) + "\n")
    task = Math(str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl"), timeout_s=1)
    assert task.reward(task.train[0], "9^9^9^9") == 0.0  # math-verify's TimeoutException is a BaseException
    assert task.step_metrics() == {"task/verify_timeouts": 1}


def test_math_rows_without_a_question_are_refused_and_unmatchable_references_are_counted(tmp_path, capsys):
    from rlkit.tasks.math import Math

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": None, "answer": "#### 5"}) + "\n")
    with pytest.raises(TaskError, match=r"task.train row 0 has no 'question' \(got None\)"):
        Math(str(bad), str(bad))
    rows = [{"question": "a", "answer": "\\boxed{5}"}, {"question": "b", "answer": "\\boxed{$$}"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = Math(str(data), str(data), answer_style="boxed")
    assert task.unsolvable == 1
    assert "task.eval: 1 of 2 rows have a reference answer that math-verify cannot match" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from rlkit.models import TinyQwen2
    from rlkit.tasks.arithmetic import ALPHABET

    path = tmp_path_factory.mktemp("hf")
    model, tok = TinyQwen2(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64
    ).build(ALPHABET, 0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_lora_targets_the_model_lacks_are_named_with_the_modules_it_has(saved_model, tmp_path):
    cfg = make_cfg(
        [
            "model=pretrained",
            f"model.path={saved_model}",
            "model.lora_r=4",
            "model.lora_targets=[c_attn,c_proj]",
            "warm_start.steps=0",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"model.lora_targets=\['c_attn', 'c_proj'\] cannot be applied.*"
        r"named \[.*'q_proj'",
    ):
        run(cfg, str(tmp_path / "run"))


def test_a_model_folder_without_tokenizer_files_is_named(saved_model, tmp_path):
    weights_only = tmp_path / "w"
    weights_only.mkdir()
    for f in saved_model.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, weights_only / f.name)
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        run(make_cfg(["model=pretrained", f"model.path={weights_only}", "warm_start.steps=0"]), str(tmp_path / "r"))


def test_an_evaluation_budget_past_the_context_is_named(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"task.eval row \d+ has a prompt of \d+ tokens; with "
        r"eval.max_new_tokens=200 it exceeds the model's context of 128",
    ):
        run(make_cfg(["eval.max_new_tokens=200", "warm_start.steps=0"]), str(tmp_path / "run"))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 150 KiB tmpfs: room for the run's small files, not for a checkpoint (needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root): the full-disk tests need one")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_exits_74_and_leaves_no_partial_files(tmp_path, tiny_disk):
    cache = tmp_path / "c"
    out = cli(tiny_disk / "run", cache, "steps=2")
    assert out.returncode == EXIT_STORAGE, out.stderr[-3000:]
    assert "could not write the step-1 checkpoint" in out.stderr and "no space left" in out.stderr
    assert "Traceback" not in out.stderr
    assert not [p for p in (tiny_disk / "run" / "checkpoints").iterdir()]  # no .tmp_ left behind


@pytest.mark.slow
def test_a_full_cache_disk_exits_74_and_leaves_no_partial_entry(tmp_path, tiny_disk):
    out = cli(tmp_path / "run", tiny_disk / "cache", "++model.hidden_size=256", "++model.intermediate_size=512")
    assert out.returncode == EXIT_STORAGE, out.stderr[-3000:]
    assert "could not write the warm-start cache" in out.stderr and "Traceback" not in out.stderr
    assert [p.name for p in (tiny_disk / "cache").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_a_read_only_run_directory_exits_2_naming_the_key(tmp_path, tiny_disk):
    (tiny_disk / "runs").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    out = cli(tiny_disk / "runs" / "run", tmp_path / "c")
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-3000:]
    assert "rlkit: error: hydra.run.dir: directory" in out.stderr and "not writable" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_damaged_warm_start_cache_is_named_and_trained_again(tmp_path, capsys):
    cache = tmp_path / "c"
    first = run(make_cfg(["steps=1"], cache_dir=str(cache)), str(tmp_path / "a"))
    (weights,) = cache.rglob("weights.pt")
    weights.write_bytes(weights.read_bytes()[:1000])
    again = run(make_cfg(["steps=1"], cache_dir=str(cache)), str(tmp_path / "b"))
    assert "is damaged (weights.pt does not match its checksum); training it again" in capsys.readouterr().err
    assert again == {**first, "wall_s": again["wall_s"]}


def test_compare_refuses_a_metric_nobody_logged(tmp_path, capsys, warm_cache):
    from rlkit.analysis.compare import main

    run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path / "run"))
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "run"), "--metric", "eval/nobody", "--baseline", "grpo"])
    assert e.value.code == 2 and "--metric eval/nobody: no run logged it" in capsys.readouterr().err
    assert not (tmp_path / "run" / "compare").exists()


def test_a_checkpoint_resumes_only_under_the_same_parallel_setting():
    with pytest.raises(ConfigError, match="written with different parallel"):
        check_resume({"parallel": "replicate", "seed": 0}, {"parallel": "shard", "seed": 0}, "ckpt")


@pytest.mark.parametrize("blocked", [False, True])
def test_a_hanging_reward_function_is_stopped_by_its_time_limit(tmp_path, blocked):
    cfg = make_cfg(
        [
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.HangingReward",
            f"++reward.functions.format.blocked={blocked}",
            "~reward.functions.format.pattern",
            "reward.timeout_s=1",
            "warm_start.steps=0",
        ]
    )
    t0 = time.time()
    with pytest.raises(
        TaskError,
        match=r"reward.functions.format was stopped on row 0 .*still running after 1 s "
        r"\(reward.timeout_s=1\)",
    ):
        run(cfg, str(tmp_path / "run"))
    assert time.time() - t0 < 60


@pytest.mark.slow
def test_a_second_signal_stops_a_hung_scorer_at_once(tmp_path, warm_cache):
    proc = subprocess.Popen(
        command(
            tmp_path / "run",
            warm_cache,
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.HangingReward",
            "~reward.functions.format.pattern",
            "reward.timeout_s=0",
            "warm_start.steps=0",
        ),
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": TESTS},
    )
    try:
        wait_for(
            lambda: (
                (tmp_path / "run" / "metrics.jsonl").exists()  # the first evaluation is logged
                and (tmp_path / "run" / "metrics.jsonl").read_text().strip()
            ),
            proc,
        )
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None  # the first signal waits for the step, which never ends
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == EXIT_PREEMPTED
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "stopped at once by a second signal (SIGINT after SIGINT)" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_refused_run_leaves_the_run_directorys_hydra_files_as_they_were(tmp_path, warm_cache):
    first = cli(tmp_path / "run", warm_cache, "steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["hardware"]["pins"] == {}  # no pins: none named
    before = {p.name: p.read_text() for p in (tmp_path / "run" / ".hydra").iterdir()}
    refused = cli(tmp_path / "run", warm_cache, "steps=1", "seed=7", "optim.lr=0.5")
    assert refused.returncode == EXIT_BAD_INPUT and "written with different seed, optim" in refused.stderr
    assert {p.name: p.read_text() for p in (tmp_path / "run" / ".hydra").iterdir()} == before


@pytest.mark.slow
def test_a_refused_run_removes_only_the_folders_it_created(tmp_path):
    (tmp_path / "mine" / "empty").mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-m", "rlkit.train", "steps=0", "hydra.run.dir=mine/empty/run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-2000:]
    assert (tmp_path / "mine" / "empty").is_dir() and not (tmp_path / "mine" / "empty" / "run").exists()


@pytest.mark.parametrize("weight", ["nan", "inf"])
def test_a_reward_weight_that_is_not_finite_is_named(tmp_path, weight):
    with pytest.raises(ConfigError, match=rf"reward.functions.format.weight must be a finite number, got {weight}"):
        run(make_cfg(["rewards=accuracy_format", f"reward.functions.format.weight={weight}"]), str(tmp_path))


def test_reward_functions_are_named_in_errors_and_numpy_numbers_are_accepted(tmp_path, warm_cache):
    cfg = make_cfg(
        [
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.NumpyReward",
            "~reward.functions.format.pattern",
            "steps=1",
        ],
        cache_dir=warm_cache,
    )
    assert run(cfg, str(tmp_path / "ok"))["steps"] == 1  # a finite np.float32 is a number
    cfg = make_cfg(
        [
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.NumpyReward",
            "~reward.functions.format.pattern",
            "++reward.functions.format.value=0",
            "++reward.functions.format.divide_by=0",
            "steps=1",
        ],
        cache_dir=warm_cache,
    )
    with pytest.raises(TaskError, match=r"reward.functions.format returned \S*nan\S* for row 0"):
        run(cfg, str(tmp_path / "nan"))
    cfg = make_cfg(
        [
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.NumpyReward",
            "~reward.functions.format.pattern",
            "++reward.functions.format.value=nan",
        ],
        cache_dir=warm_cache,
    )
    with pytest.raises(ConfigError, match=r"reward.functions.format.value must be a finite number, got nan"):
        run(cfg, str(tmp_path / "nan_config"))


def test_file_answers_keep_the_files_text(tmp_path):
    from rlkit.tasks.files import FileTask

    (tmp_path / "d.jsonl").write_text(
        '{"prompt": "a", "answer": 1.50}\n{"prompt": "b", "answer": 12345678901234567890}\n'
        '{"prompt": "c", "answer": "x"}\n{"prompt": "d", "answer": 7}\n'
    )
    (tmp_path / "d.csv").write_text("prompt,answer\na,007\nb,1.50\nc,NA\n")
    assert FileTask(str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl")).train["answer"] == [
        "1.50",
        "12345678901234567890",
        "x",
        "7",
    ]
    assert FileTask(str(tmp_path / "d.csv"), str(tmp_path / "d.csv"), format="csv").train["answer"] == [
        "007",
        "1.50",
        "NA",
    ]


def test_the_ranks_of_one_launch_resolve_the_same_default_run_directory(monkeypatch):
    """The processes of one launch, started a second apart, read the same time: their common
    parent's start (here this process's parent), not their own."""
    from rlkit.parallel import launch_time

    monkeypatch.setenv("WORLD_SIZE", "2")
    first = launch_time()
    time.sleep(1.1)
    assert launch_time() == first and first is not None and (datetime.now() - first).total_seconds() > 1
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert launch_time() is None  # a single process: the run directory's own time


@pytest.mark.slow
def test_portable_mode_pins_avx2_and_changes_nothing_where_avx2_already_runs(tmp_path):
    cache = tmp_path / "c"
    from rlkit.hardware import PORTABLE_ENV

    pinned = cli(tmp_path / "pinned", cache, env=PORTABLE_ENV)
    portable = cli(tmp_path / "portable", cache, "portable=true")
    assert pinned.returncode == 0 and portable.returncode == 0, (pinned.stderr[-2000:], portable.stderr[-2000:])
    assert metrics(tmp_path / "pinned") == metrics(tmp_path / "portable")
    hw = json.loads((tmp_path / "portable" / "run.json").read_text())["hardware"]
    assert hw["cpu_capability"] == "AVX2" and hw["pins"] == PORTABLE_ENV and hw["cpu"]


FUZZ_SEEN = []


@settings(
    max_examples=14,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)  # a failure is reported as drawn, not shrunk
@given(
    st.sampled_from(["reward"] * 3 + ["model", "math"]),
    st.sampled_from(sorted(__import__("helpers").ODD)),
    st.sampled_from(["ok", "missing", "file", "empty_dir", "no_tokenizer", "corrupt_weights"]),
    st.lists(
        st.sampled_from(
            [
                '{"question": "1+1", "answer": "#### 2"}',
                '{"question": null, "answer": "#### 1"}',
                '{"question": "q", "answer": null}',
                '{"question": "q", "answer": "no marker"}',
                '{"question": "q", "answer": "#### 9^9^9^9"}',
                '{"question": 3, "answer": "#### 3"}',
                '{"q": "x"}',
                "not json",
                "",
            ]
        ),
        min_size=1,
        max_size=4,
    ),
)
@pytest.mark.slow
@example("model", "int", "missing", [""]).via("every model-path kind at least once")
@example("model", "int", "file", [""]).via("every model-path kind at least once")
@example("model", "int", "empty_dir", [""]).via("every model-path kind at least once")
@example("model", "int", "no_tokenizer", [""]).via("every model-path kind at least once")
@example("model", "int", "corrupt_weights", [""]).via("every model-path kind at least once")
def test_fuzzed_reward_functions_model_paths_and_math_files_run_or_fail_with_rlkits_message(
    tmp_path_factory, warm_cache, saved_model, what, odd, model, lines
):
    """No traceback from deep inside: each example trains or stops with rlkit's own error."""
    d = tmp_path_factory.mktemp("fuzz")
    if what == "reward":
        extra = [
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.OddReward",
            f"++reward.functions.format.kind='{odd}'",
            "~reward.functions.format.pattern",
            "reward.timeout_s=1",
        ]
    elif what == "model":
        path = {"ok": saved_model, "missing": d / "nowhere", "file": d / "file", "empty_dir": d / "empty"}.get(
            model, d / "m"
        )
        (d / "file").write_text("x")
        (d / "empty").mkdir()
        if model in ("no_tokenizer", "corrupt_weights"):
            shutil.copytree(saved_model, path)
            for f in ["tokenizer.json", "tokenizer_config.json"] if model == "no_tokenizer" else []:
                (path / f).unlink(missing_ok=True)
            if model == "corrupt_weights":
                (path / "model.safetensors").write_bytes(b"\0" * 100)
        extra = ["model=pretrained", f"model.path={path}", "warm_start.steps=0"]
    else:
        (d / "m.jsonl").write_text("\n".join(lines) + "\n")
        extra = [
            "task=math",
            f"task.train={d / 'm.jsonl'}",
            f"task.eval={d / 'm.jsonl'}",
            "task.timeout_s=1",
            "task.prompt_template='{question}='",
            "warm_start.steps=0",
            "rollout.max_new_tokens=8",
        ]
    try:
        run(make_cfg(["steps=1", *extra], cache_dir=warm_cache), str(d / "run"))
        outcome = "ran"
    except (ConfigError, TaskError) as e:
        assert str(e)
        outcome = f"{type(e).__name__}: {str(e)[:90]}"
    FUZZ_SEEN.append((what, odd if what == "reward" else model if what == "model" else lines, outcome))
    print("fuzz:", FUZZ_SEEN[-1])
