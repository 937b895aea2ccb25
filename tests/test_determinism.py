"""The same seed and config give the same numbers: run twice, whatever filled the warm-start cache
before, in a parallel sweep on an empty cache, in portable mode, and for every rank of a launch."""

import json
import time
from datetime import datetime

import pytest

from cli import metrics, sweep, train
from conftest import make_cfg
from rlkit.session import run


def test_same_seed_same_config_same_metrics(tmp_path, warm_cache):
    for name in ("a", "b"):
        run(make_cfg(["steps=3", "optim.epochs=2", "algo=ppo"], cache_dir=warm_cache), str(tmp_path / name))
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")


def test_same_seed_gives_the_same_metrics_whatever_filled_the_cache(tmp_path):
    run(make_cfg(["seed=0"], cache_dir=str(tmp_path / "empty")), str(tmp_path / "alone"))
    run(make_cfg(["seed=1"], cache_dir=str(tmp_path / "shared")), str(tmp_path / "first"))
    run(make_cfg(["seed=0"], cache_dir=str(tmp_path / "shared")), str(tmp_path / "after"))
    assert metrics(tmp_path / "alone") == metrics(tmp_path / "after")
    assert metrics(tmp_path / "first")[0] == metrics(tmp_path / "after")[0]  # both seeds start from one policy


@pytest.mark.slow
def test_a_parallel_sweep_on_an_empty_cache_warm_starts_once_and_every_job_uses_it(tmp_path):
    out = sweep(tmp_path / "sweep", tmp_path / "cache", "seed=0,1", "steps=1")
    assert out.returncode == 0, out.stderr[-3000:]
    infos = [json.loads(p.read_text())["warm_start"] for p in sorted((tmp_path / "sweep").rglob("run.json"))]
    assert len(infos) == 2 and infos[0]["cache"] == infos[1]["cache"]
    assert sorted(i["trained"] for i in infos) == [False, True]  # one job trained it, the other waited and loaded it
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1
    starts = [metrics(p.parent)[0] for p in sorted((tmp_path / "sweep").rglob("metrics.jsonl"))]
    assert starts[0] == starts[1]


@pytest.mark.slow
def test_portable_mode_pins_avx2_and_changes_nothing_where_avx2_already_runs(tmp_path, warm_cache):
    from rlkit.hardware import PORTABLE_ENV

    pinned = train(tmp_path / "pinned", warm_cache, env=PORTABLE_ENV)  # both from the same cached warm start
    portable = train(tmp_path / "portable", warm_cache, "portable=true")
    assert pinned.returncode == 0 and portable.returncode == 0, (pinned.stderr[-2000:], portable.stderr[-2000:])
    assert metrics(tmp_path / "pinned") == metrics(tmp_path / "portable")
    hw = json.loads((tmp_path / "portable" / "run.json").read_text())["hardware"]
    assert hw["cpu_capability"] == "AVX2" and hw["pins"] == PORTABLE_ENV and hw["cpu"]


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
