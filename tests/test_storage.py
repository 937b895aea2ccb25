"""A full, read-only or damaged disk: exit 74 (or 2 naming the key) with one line, no partial file
left behind, earlier checkpoints intact, a damaged cache entry named and rebuilt."""

import subprocess

import pytest

from cli import run_cli, train
from conftest import make_cfg
from rlkit.exits import EXIT_BAD_INPUT, EXIT_STORAGE
from rlkit.refusals import ConfigError
from rlkit.session import run


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_exits_74_and_leaves_no_partial_files(tiny_disk, warm_cache):
    out = train(tiny_disk / "run", warm_cache, "steps=2")
    assert out.returncode == EXIT_STORAGE, out.stderr[-3000:]
    assert "could not write the step-1 checkpoint" in out.stderr and "no space left" in out.stderr
    assert "Traceback" not in out.stderr
    assert not [p for p in (tiny_disk / "run" / "checkpoints").iterdir()]  # no .tmp_ left behind


@pytest.mark.slow
def test_a_full_cache_disk_exits_74_and_leaves_no_partial_entry(tmp_path, tiny_disk):
    out = train(tmp_path / "run", tiny_disk / "cache", "++model.hidden_size=256", "++model.intermediate_size=512")
    assert out.returncode == EXIT_STORAGE, out.stderr[-3000:]
    assert "could not write the warm-start cache" in out.stderr and "Traceback" not in out.stderr
    assert [p.name for p in (tiny_disk / "cache").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", ["3m", "12m"], indirect=True)
def test_a_full_disk_in_any_writer_exits_74_with_one_line(tmp_path, small_disk):
    """The default model's checkpoint: safetensors reports the full disk with its own error type."""
    out = run_cli(
        [
            "threads=1",
            "steps=2",
            "warm_start.steps=2",
            "eval.every=0",
            "logger=jsonl",
            "checkpoint.every=1",
            f"warm_start.cache_dir={tmp_path / 'cache'}",
            f"hydra.run.dir={small_disk / 'run'}",
        ]
    )
    assert out.returncode == EXIT_STORAGE, out.stderr[-3000:]
    assert "no space left on the device" in out.stderr and "Traceback" not in out.stderr
    assert not [p for p in (small_disk / "run" / "checkpoints").iterdir() if p.name.startswith(".tmp_")]


@pytest.mark.slow
def test_a_read_only_run_directory_exits_2_naming_the_key(tmp_path, tiny_disk):
    (tiny_disk / "runs").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    out = train(tiny_disk / "runs" / "run", tmp_path / "c")
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-3000:]
    assert "rlkit: error: hydra.run.dir: directory" in out.stderr and "not writable" in out.stderr
    assert "Traceback" not in out.stderr


def test_unwritable_output_directory_is_reported(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="hydra.run.dir: directory .* is not writable"):
        run(make_cfg([]), str(tmp_path / "file" / "run"))


def test_a_damaged_warm_start_cache_is_named_and_trained_again(tmp_path, capsys):
    cache = tmp_path / "c"
    first = run(make_cfg(["steps=1"], cache_dir=str(cache)), str(tmp_path / "a"))
    (weights,) = cache.rglob("weights.pt")
    weights.write_bytes(weights.read_bytes()[:1000])
    again = run(make_cfg(["steps=1"], cache_dir=str(cache)), str(tmp_path / "b"))
    assert "is damaged (weights.pt does not match its checksum); training it again" in capsys.readouterr().err
    assert again == {**first, "wall_s": again["wall_s"], "session_s": again["session_s"]}  # times aside, the same
