"""Bad numbers, bad files and a full disk are refused with one line naming the key or the file
(exit 2, or 74 for storage), before anything is allocated or written; nothing of an earlier run is
lost. Each test fails on a build that lacks the check it names."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from conftest import FAST, make_cfg
from rlkit.config import ConfigError, numbers
from rlkit.exits import EXIT_BAD_INPUT, EXIT_STORAGE
from rlkit.metrics import by_difficulty
from rlkit.setup import validate
from rlkit.tasks.base import TaskError
from rlkit.tasks.files import FileTask
from rlkit.train import run
from test_reliability import command

CONF = Path(__file__).resolve().parents[1] / "conf"
TESTS = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
SKIP_GROUPS = {"hydra", "experiment"}


@functools.lru_cache(maxsize=None)
def numeric_keys() -> list[tuple[str, str]]:
    """(group option override, dotted key) for every number of every option of every group."""
    out = []
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in SKIP_GROUPS):
        for option in sorted(group.glob("*.yaml")):
            choice = f"{group.name}={option.stem}"
            for key, _ in numbers(OmegaConf.to_container(make_cfg([choice]), resolve=True)):
                if group.name == "algo" or key.split(".")[0] in (group.name, "reward"):
                    out.append((choice, key))
    top = [("algo=grpo", k) for k, _ in numbers(OmegaConf.to_container(make_cfg(), resolve=True))]
    return sorted(set(out + top))


KEYS = st.deferred(lambda: st.sampled_from(numeric_keys()))  # composed on first use, not at collection


def cli(*overrides, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "rlkit.train", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": TESTS},
    )


def refusal(choice: str, key: str, value: str) -> str | None:
    """What refuses `key=value`: Hydra's composition (a typed key; the CLI exits 2 with it) or
    `validate`; None when both accept it. Any other exception fails the test."""
    from hydra.errors import ConfigCompositionException

    try:
        cfg = make_cfg([choice, f"{key}={value}"])
    except ConfigCompositionException as e:
        return f"{e} {e.__cause__}"
    try:
        validate(cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True)  # the same examples every run
@given(pick=KEYS, value=st.sampled_from(["nan", "inf", "-inf"]))
def test_every_number_of_every_group_must_be_finite(pick, value):
    choice, key = pick
    message = refusal(choice, key, value)
    assert message is not None and key in message, (pick, value, message)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True)
@given(pick=KEYS, value=st.sampled_from(["-1", "0", "-1e30", "1e30", "-0.5", "4294967296"]))
def test_out_of_range_numbers_are_accepted_or_refused_naming_their_key(pick, value):
    choice, key = pick
    message = refusal(choice, key, value)
    assert message is None or key.split(".")[-1] in message, (pick, value, message)


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=-1", "seed must be in [0, 4294967295], got -1"),
        ("seed=100000000000000000000000", "seed must be in [0, 4294967295], got 100000000000000000000000"),
        ("eval.seed=-3", "eval.seed must be in [0, 4294967295]"),
        ("eval.batch_size=0", "eval.batch_size must be >= 1, got 0"),
        ("loss.beta=nan", "loss.beta must be a finite number, got nan"),
        ("loss.eps_high=nan", "loss.eps_high must be a finite number, got nan"),
        ("loss.entropy_coef=nan", "loss.entropy_coef must be a finite number, got nan"),
        ("threads=-1", "threads must be >= 0"),
        ("warm_start.batch_size=0", "warm_start.batch_size must be >= 1"),
        ("optim.beta2=1", "optim.beta1 and optim.beta2 must be in [0, 1)"),
    ],
)
def test_bad_numbers_are_refused_before_anything_is_built(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        run(make_cfg([override]), str(tmp_path / "run"))
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_rollout_too_large_for_memory_is_refused_with_its_size_before_allocating(tmp_path):
    cfg = make_cfg(["rollout.group_size=100000000", "rollout.prompts_per_step=1", "warm_start.steps=0"])
    with pytest.raises(
        ConfigError,
        match=r"rollout.prompts_per_step x rollout.group_size = 100000000 completions "
        r"of up to \d+ tokens need at least [\d.]+ GiB .* GiB are free on cpu",
    ):
        run(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def write_csv(path: Path, text: str, bom: bool = False) -> str:
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return str(path)


def test_csv_files_empty_with_a_bom_or_with_bad_difficulties_are_named(tmp_path):
    empty = write_csv(tmp_path / "empty.csv", "")
    with pytest.raises(TaskError, match=r"task.train_path: .*empty.csv.*the file is empty: a CSV file needs a header"):
        FileTask(empty, empty, format="csv")
    ragged = write_csv(tmp_path / "ragged.csv", "prompt,answer\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(TaskError, match=r"line 3 has 3 fields, the header 2"):
        FileTask(ragged, ragged, format="csv")
    bom = write_csv(tmp_path / "bom.csv", "prompt,answer,difficulty\n1+1=,2,1\n2+2=,4,1.5\n", bom=True)
    task = FileTask(bom, bom, format="csv")
    assert task.train.column_names == ["prompt", "answer", "difficulty"] and task.train["difficulty"] == [1.0, 1.5]
    import torch

    assert by_difficulty(list(task.train), torch.tensor([1.0, 0.0]), "acc") == {"acc_d1": 1.0, "acc_d1.5": 0.0}
    words = write_csv(tmp_path / "words.csv", "prompt,answer,difficulty\n1+1=,2,1\n2+2=,4,hard\n")
    with pytest.raises(TaskError, match=r"task.train row 1 has difficulty 'hard'; the difficulty column must hold"):
        FileTask(words, words, format="csv")


@pytest.mark.slow
def test_a_non_numeric_difficulty_exits_2_and_leaves_no_run_directory(tmp_path):
    data = write_csv(tmp_path / "d.csv", "prompt,answer,difficulty\n1+1=,2,easy\n")
    out = cli(
        "task=files",
        "task.format=csv",
        f"task.train_path={data}",
        f"task.eval_path={data}",
        "steps=1",
        "warm_start.steps=0",
        "logger=jsonl",
        "hydra.run.dir=runs/a",
        cwd=tmp_path,
    )
    assert out.returncode == EXIT_BAD_INPUT and "has difficulty 'easy'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of the size the test asks for (needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (not root): the full-disk tests need one")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", ["3m", "12m"], indirect=True)
def test_a_full_disk_in_any_writer_exits_74_with_one_line(tmp_path, small_disk):
    """The default model's checkpoint: safetensors reports the full disk with its own error type."""
    out = cli(
        "threads=1",
        "steps=2",
        "warm_start.steps=2",
        "eval.every=0",
        "logger=jsonl",
        "checkpoint.every=1",
        f"warm_start.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={small_disk / 'run'}",
    )
    assert out.returncode == EXIT_STORAGE, out.stderr[-3000:]
    assert "no space left on the device" in out.stderr and "Traceback" not in out.stderr
    assert not [p for p in (small_disk / "run" / "checkpoints").iterdir() if p.name.startswith(".tmp_")]


@pytest.mark.slow
def test_starting_over_moves_the_earlier_runs_hydra_record_with_it(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    first = subprocess.run(
        command(run_dir, warm_cache, "steps=1", "seed=3"), capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr[-3000:]
    earlier = {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()}
    assert "seed=3" in earlier["overrides.yaml"]
    again = subprocess.run(
        command(run_dir, warm_cache, "steps=1", "seed=4", "checkpoint.resume=false"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    (previous,) = (run_dir / "previous_runs").iterdir()
    assert {p.name: p.read_text() for p in (previous / ".hydra").iterdir()} == earlier
    assert "seed=4" in (run_dir / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_a_refusal_under_rlkit_launch_ends_with_the_refusal_not_a_traceback(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit.parallel.launch",
            "--nproc-per-node=2",
            "-m",
            "rlkit.train",
            *FAST,
            "warm_start.steps=0",
            "parallel=shard",
            "engine=off_policy",
            "hydra.run.dir=run",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": TESTS},
    )
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-3000:]
    assert "rlkit: error:" in out.stderr and "Traceback" not in out.stderr and "FileNotFoundError" not in out.stderr
    assert not (tmp_path / "run").exists()
