"""Data parallel with gloo on CPU: two processes give the single-process update on the same batch,
groups never span ranks, rank 0 alone writes, and a two-process run resumes."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import FAST, make_cfg
from ddp_worker import snapshot, update_on, update_on_shard
from rlkit import parallel
from rlkit.loop import make_rollout
from rlkit.refusals import ConfigError
from rlkit.setup import setup, validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "plugins"))  # the example plugin


pytestmark = pytest.mark.slow  # real-model and multi-process runs: `pytest -m "not slow"` leaves them out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PARALLEL_CASES = {
    "token_mean": ["aggregator=token_mean"],
    "seq_mean_token_mean": ["aggregator=seq_mean_token_mean"],
    # 4 groups generated, 2 kept: the first two informative groups of the whole batch (set below)
    "dynamic_sampling": [
        "sampler=dapo",
        "sampler.oversample=2",
        "sampler.max_gen_batches=1",
        "rollout.prompts_per_step=2",
    ],
    "batch_std": ["advantage.std_scope=batch"],
    "gae_whitening_and_critic": ["algo=ppo", "optim.epochs=1", "optim.mini_batches=1"],
    "shard": ["parallel=shard", "optim.micro_batch_size=0"],  # sharded policy and reference (one process: unsharded)
    "shared_prefix": ["optim.share_prefix=always", "optim.micro_batch_size=0"],  # each rank's groups share prompts
    # the example plugin's batch-wide std (experiments/plugins), taken over both processes' groups
    "example_plugin": ["advantage=dr_grpo", "advantage._target_=rlkit_example_plugin.advantage.BatchStdBaseline"],
}


def test_a_process_that_joined_a_group_exits_with_its_status_and_its_output_flushed():
    """`parallel.exit_process` (how a rank of rlkit-train ends) skips the interpreter's teardown, where
    a sharded model's leftover gloo group can abort the process, but runs the `atexit` functions
    (wandb's finish) and flushes both streams."""
    code = (
        "import atexit, sys; from rlkit import parallel; print('out', end=''); print('err', end='', file=sys.stderr); "
        "atexit.register(lambda: print(' at exit', end='', file=sys.stderr)); parallel.exit_process(75)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a pipe is by default
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (75, "out", "err at exit")


def case_overrides(case: str, processes: int) -> list[str]:
    """The case's overrides; one process runs `parallel=shard` unsharded, i.e. without it."""
    full = ["optim.micro_batch_size=3", "rollout.prompts_per_step=4", *PARALLEL_CASES[case]]
    return full if processes > 1 else [o for o in full if o != "parallel=shard"]


@pytest.fixture(scope="module")
def updates(tmp_path_factory, warm_cache):
    """Every case's update by one process, then by two processes on the same rollout (one process
    group runs all the cases: a spawn costs seconds).  -> {case: (one snapshot, kept, two snapshot)}"""
    ones, jobs = {}, []
    for case in PARALLEL_CASES:
        out = tmp_path_factory.mktemp(case)
        state = setup(make_cfg(case_overrides(case, 1), cache_dir=warm_cache), str(out / "single"), {})
        rollout = make_rollout(state, [state.parts.task.train[i] for i in range(4)])
        if case == "dynamic_sampling":  # group 0 (rank 0) uninformative, groups 1-3 informative: keeps 1 and 2
            rollout.rewards = torch.tensor([0.0] * 4 + [1.0, 0, 0, 0] * 3)
        torch.save(rollout, out / "rollout.pt")
        stats, kept = update_on(state, rollout)
        ones[case] = (snapshot(state, stats), kept)
        jobs.append((case_overrides(case, 2), str(out / "rollout.pt"), str(out)))
    mp.spawn(update_on_shard, args=(2, free_port(), jobs, warm_cache), nprocs=2)
    return {
        case: (*ones[case], torch.load(os.path.join(job[2], "params.pt"))) for case, job in zip(PARALLEL_CASES, jobs)
    }


@pytest.mark.parametrize("case", list(PARALLEL_CASES))
def test_two_processes_give_the_single_process_update_on_the_same_batch(updates, warm_cache, tmp_path, case):
    one, kept, two = updates[case]
    assert two["kept"] == kept == (2 if case == "dynamic_sampling" else None)
    # the gradient itself (its global norm, before clipping; Adam's first step would hide a scale error)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert two["value_losses"] == pytest.approx(one["value_losses"], rel=1e-5)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    for which in ("params", "critic"):
        diffs = {k: float((v - two[which][k]).abs().max()) for k, v in one[which].items()}
        assert max(diffs.values(), default=0) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    assert (case == "gae_whitening_and_critic") == bool(one["critic"])
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            one["params"].values(),
            setup(make_cfg(case_overrides(case, 1), cache_dir=warm_cache), str(tmp_path / "fresh"), {})
            .parts.policy.state_dict()
            .values(),
        )
    )


def test_each_rank_keeps_whole_groups():
    prompts = list(range(8))
    shards = [parallel.shard(prompts, r, 2) for r in range(2)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]]  # groups are formed after sharding: G copies of each prompt


def test_what_does_not_divide_among_the_processes_is_refused():
    with pytest.raises(ConfigError, match="rollout.prompts_per_step=3 must divide among 2 processes"):
        validate(make_cfg(["rollout.prompts_per_step=3"]), world=2)
    with pytest.raises(ConfigError, match="= 6 prompts per generation batch must divide among 4 processes"):
        validate(make_cfg(["sampler=dapo", "sampler.oversample=1.5"]), world=4)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([], 1, "parallel=shard shards over several processes"),
        (["algo=ppo"], 2, "parallel=shard does not shard a critic yet"),
        (["sampler=dapo"], 2, "parallel=shard needs as many micro-batches on every process"),
        (["optim.micro_batch_tokens=512"], 2, "parallel=shard needs as many micro-batches on every process"),
    ],
)
def test_sharding_refuses_what_it_does_not_shard_yet(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(["parallel=shard", *overrides]), world=world)
    validate(make_cfg(["parallel=shard"]), world=2)  # the default composes with it


def torchrun(run_dir, cache, *extra):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port",
            str(free_port()),
            "-m",
            "rlkit.train",
            *FAST,
            f"warm_start.cache_dir={cache}",
            f"hydra.run.dir={run_dir}",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_a_sharded_two_process_run_writes_once_and_resumes_to_the_uninterrupted_metrics(tmp_path, warm_cache):
    """parallel=shard: rank 0 alone writes; the sharded weights and Adam state go through a full
    checkpoint and back (a replicated run's resume: the kill -9 test below)."""
    import shutil

    args = ("steps=4", "checkpoint.every=2", "parallel=shard")
    whole = torchrun(tmp_path / "whole", warm_cache, *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uninterrupted = [json.loads(l) for l in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in uninterrupted] == list(range(5))  # rank 0 alone writes
    info = json.loads((tmp_path / "whole" / "run.json").read_text())
    assert info["processes"] == 2 and info["parallel"] == "Sharded"
    state = torch.load(tmp_path / "whole" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert len(state["rng_ranks"]) == 2
    # the run as a kill after step 4's metrics and before its checkpoint leaves it: step 3 needs Adam's state of step 2
    shutil.copytree(tmp_path / "whole", tmp_path / "run", ignore=shutil.ignore_patterns("step_000004"))
    again = torchrun(tmp_path / "run", warm_cache, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resuming from") == 2 and "(step 2)" in again.stderr  # both ranks
    resumed = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in resumed] == list(range(5))
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/kl", "train/reward"):
            assert resumed[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-4, abs=1e-7), (step, key)


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


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_metrics(tmp_path, warm_cache):
    """kill -9 the whole torchrun job after its step-4 checkpoint; the rerun restores every rank's RNG."""
    from cli import metrics

    args = ["steps=10", "checkpoint.every=2", "eval.every=5"]
    ref = torchrun(tmp_path / "ref", warm_cache, *args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path / "ref")] == list(range(11))  # rank 0 alone writes
    info = json.loads((tmp_path / "ref" / "run.json").read_text())
    assert info["processes"] == 2 and info["parallel"] == "Replicated"
    state = torch.load(tmp_path / "ref" / "checkpoints" / "step_000010" / "trainer_state.pt", weights_only=False)
    assert len(state["rng_ranks"]) == 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        str(free_port()),
        "-m",
        "rlkit.train",
        *FAST,
        f"warm_start.cache_dir={warm_cache}",
        f"hydra.run.dir={tmp_path / 'run'}",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.time() + 300
    while not (tmp_path / "run" / "checkpoints" / "step_000004").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    kill_all(f"hydra.run.dir={tmp_path / 'run'}")  # the agent and both ranks (torchrun starts them in new sessions)
    proc.wait()
    assert metrics(tmp_path / "run")[-1]["step"] < 10
    again = torchrun(tmp_path / "run", warm_cache, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resuming from") == 2 and "(step 10)" not in again.stderr  # both ranks, mid-run
    assert metrics(tmp_path / "run") == metrics(tmp_path / "ref")


def test_the_tasks_of_a_slurm_job_train_as_one_data_parallel_run(tmp_path, warm_cache):
    """What srun (or `hydra/launcher=slurm_ddp`) starts: one process per task, with SLURM's
    variables and none of torchrun's; they join one group and train as a two-process run."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    tasks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlkit.train",
                *FAST,
                f"warm_start.cache_dir={warm_cache}",
                f"hydra.run.dir={tmp_path / 'run'}",
                "steps=2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
        )
        for r in range(2)
    ]
    for t in tasks:
        _, err = t.communicate(timeout=600)
        assert t.returncode == 0, err[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["processes"] == 2


def test_sigterm_to_the_launcher_checkpoints_every_rank_and_exits_75(tmp_path, warm_cache):
    """What a scheduler does on preemption: SIGTERM to the launcher, which forwards it to the ranks."""
    from cli import metrics

    cmd = [
        sys.executable,
        "-m",
        "rlkit.parallel.launch",
        "--nproc_per_node=2",
        "--master_port",
        str(free_port()),
        "-m",
        "rlkit.train",
        *FAST,
        f"warm_start.cache_dir={warm_cache}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "steps=200",
        "checkpoint.every=0",
        "eval.every=0",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 300
        while not ((tmp_path / "run" / "metrics.jsonl").exists() and len(metrics(tmp_path / "run")) > 2):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75
    finally:
        proc.kill()
    err = proc.stderr.read()
    # torchrun signals the ranks one after the other: a rank whose signal lands after the ranks agreed
    # to stop stops on the other's word, and says so
    stopped = re.findall(r"stopped by (SIGTERM|a signal to another rank) after step", err)
    assert len(stopped) == 2 and "SIGTERM" in stopped, err[-2000:]
    assert "rlkit-launch: stopped by SIGTERM" in err
    assert "Traceback" not in err
    last = metrics(tmp_path / "run")[-1]["step"]
    assert (tmp_path / "run" / "checkpoints" / f"step_{last:06d}").is_dir()


def test_a_failure_on_one_rank_stops_the_others_with_one_named_line(tmp_path, warm_cache):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit.parallel.launch",
            "--nproc_per_node=2",
            "--master_port",
            str(free_port()),
            "-m",
            "rlkit.train",
            *FAST,
            f"warm_start.cache_dir={warm_cache}",
            f"hydra.run.dir={tmp_path / 'run'}",
            "rewards=accuracy_format",
            "++reward.functions.format._target_=helpers.FailsOnRank1",
            "~reward.functions.format.pattern",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(__file__)},
    )
    assert out.returncode == 2, out.stderr[-3000:]  # rank 1's bad input, not torchrun's 1
    assert "reward.functions.format raised on row 0" in out.stderr  # rank 1's own error
    assert "another process of this run failed (its message is above)" in out.stderr  # rank 0's one line
    assert "rlkit-launch: rank 1 exited with code 2" in out.stderr and "Traceback" not in out.stderr


def test_a_coupled_rollout_is_the_same_from_two_processes_as_from_one(tmp_path, warm_cache):
    """rollout.coupled=true keys each token's uniform by the row, not by its rank or batch: the
    first step's rollout (from one starting policy) is the same split over two processes as in one;
    two processes twice give the same numbers."""
    args = ("steps=1", "rollout.coupled=true", "eval.every=0", "checkpoint.every=0")
    for name in ("two", "again"):
        out = torchrun(tmp_path / name, warm_cache, *args)
        assert out.returncode == 0, out.stderr[-3000:]
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit.train",
            *FAST,
            f"warm_start.cache_dir={warm_cache}",
            *args,
            f"hydra.run.dir={tmp_path / 'one'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two, again, single = (
        [json.loads(line) for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()][-1]
        for n in ("two", "again", "one")
    )
    untimed = [k for k in two if not k.startswith(("time/", "perf/"))]
    assert [two[k] for k in untimed] == [again[k] for k in untimed]
    for key in ("train/reward", "train/completion_len", "train/frac_zero_std_groups"):
        assert two[key] == pytest.approx(single[key], rel=1e-6), key
    assert 2 * two["train/gen_tokens"] == single["train/gen_tokens"]  # logged as the mean over the processes
