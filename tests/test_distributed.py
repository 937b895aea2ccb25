"""Data parallel with gloo on CPU: two processes give the single-process update on the same batch,
groups never span ranks, rank 0 alone writes, and a two-process run resumes."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from conftest import FAST, make_cfg
from ddp_worker import update_on_shard
from rlkit import distributed
from rlkit.config import ConfigError, validate
from rlkit.setup import setup
from rlkit.train import Timer, collect, prepare, update


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("aggregator", ["token_mean", "seq_mean_token_mean"])
def test_two_processes_give_the_single_process_update_on_the_same_batch(tmp_path, aggregator):
    overrides = [f"aggregator={aggregator}", "optim.micro_batch_size=3", "rollout.prompts_per_step=4"]
    state = setup(make_cfg(overrides, cache_dir=str(tmp_path / "c")), str(tmp_path / "single"), {})
    state.timer = Timer()
    rollout, _ = collect(state)
    torch.save(rollout, tmp_path / "rollout.pt")
    stats = update(state, prepare(state, rollout))
    mp.spawn(update_on_shard, args=(2, free_port(), overrides, str(tmp_path / "c"), str(tmp_path / "rollout.pt"),
                                    str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "params.pt")
    # the gradient itself (its global norm, before clipping; Adam's first step would hide a scale error)
    assert two["grad_norms"] == pytest.approx(stats.grad_norms, rel=1e-5)
    one = state.policy.state_dict()
    assert max(float((one[k] - two["params"][k]).abs().max()) for k in one) < 1e-5
    assert any(not torch.equal(a, b) for a, b in zip(one.values(), setup(
        make_cfg(overrides, cache_dir=str(tmp_path / "c")), str(tmp_path / "fresh"), {}).policy.state_dict().values()))


def test_each_rank_keeps_whole_groups():
    prompts = list(range(8))
    shards = [distributed.shard(prompts, r, 2) for r in range(2)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]]  # groups are formed after sharding: G copies of each prompt


@pytest.mark.parametrize("override, message", [
    ("sampler=dapo", "sampler=rlkit.samplers.DynamicSampling does not run data-parallel yet"),
    ("algo=ppo", "advantage=rlkit.advantages.GAE does not run data-parallel yet"),
    ("rollout.prompts_per_step=3", "rollout.prompts_per_step=3 must divide among 2 processes"),
])
def test_what_does_not_run_data_parallel_yet_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg([override]), world=2)


def torchrun(run_dir, cache, *extra):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                           str(free_port()), "-m", "rlkit.train", *FAST, f"warm_start.cache_dir={cache}",
                           f"hydra.run.dir={run_dir}", *extra], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_two_process_run_writes_once_and_resumes(tmp_path):
    out = torchrun(tmp_path / "run", tmp_path / "c", "steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2]  # rank 0 alone writes
    assert json.loads((tmp_path / "run" / "run.json").read_text())["processes"] == 2
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert len(state["rng_ranks"]) == 2
    again = torchrun(tmp_path / "run", tmp_path / "c", "steps=3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resuming from") == 2  # both ranks
    assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def kill_all(marker: str) -> None:
    """SIGKILL every process whose command line holds `marker`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_metrics(tmp_path):
    """kill -9 the whole torchrun job after its step-4 checkpoint; the rerun restores every rank's RNG."""
    from test_reliability import metrics
    args = ["steps=10", "checkpoint.every=2", "eval.every=5"]
    ref = torchrun(tmp_path / "ref", tmp_path / "c", *args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           "-m", "rlkit.train", *FAST, f"warm_start.cache_dir={tmp_path / 'c'}", f"hydra.run.dir={tmp_path / 'run'}",
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (tmp_path / "run" / "checkpoints" / "step_000004").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    kill_all(f"hydra.run.dir={tmp_path / 'run'}")  # the agent and both ranks (torchrun starts them in new sessions)
    proc.wait()
    assert metrics(tmp_path / "run")[-1]["step"] < 10
    again = torchrun(tmp_path / "run", tmp_path / "c", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resuming from") == 2 and "(step 10)" not in again.stderr  # both ranks, mid-run
    assert metrics(tmp_path / "run") == metrics(tmp_path / "ref")
