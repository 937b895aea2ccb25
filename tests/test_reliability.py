"""Reliability: kill -9 and resume, SIGTERM, non-finite guard, bad input, fuzzing, determinism."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from hydra.errors import ConfigCompositionException, HydraException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import FAST, make_cfg
from rlkit.config import ConfigError
from rlkit.exits import EXIT_PREEMPTED
from rlkit.guards import NonFiniteError
from rlkit.tasks.base import TaskError
from rlkit.train import run

TIMING = ("time/", "perf/")


def metrics(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in l.items() if not k.startswith(TIMING)} for l in lines]


def command(run_dir, cache, *extra):
    return [
        sys.executable,
        "-m",
        "rlkit.train",
        *FAST,
        f"warm_start.cache_dir={cache}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def wait_for(cond, proc, timeout=180):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.01)


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_uninterrupted_metrics(tmp_path, warm_cache):
    args = ["steps=14", "checkpoint.every=2", "eval.every=3"]
    ref = subprocess.run(command(tmp_path / "ref", warm_cache, *args), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    proc = subprocess.Popen(command(tmp_path / "run", warm_cache, *args), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "run" / "checkpoints" / "step_000004").exists(), proc)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    partial = metrics(tmp_path / "run")
    assert partial[-1]["step"] < 14
    again = subprocess.run(command(tmp_path / "run", warm_cache, *args), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    assert metrics(tmp_path / "run") == metrics(tmp_path / "ref")


@pytest.mark.slow
def test_sigterm_writes_a_loadable_checkpoint_and_exits_distinctly(tmp_path, warm_cache):
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
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED
    err = proc.stderr.read()
    assert "stopped by SIGTERM after step" in err and "Traceback" not in err
    last = metrics(run_dir)[-1]["step"]
    ckpt = run_dir / "checkpoints" / f"step_{last:06d}"
    assert AutoModelForCausalLM.from_pretrained(ckpt / "policy") is not None
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == last


def policy_weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "policy" / "model.safetensors")


def test_a_planted_nan_skips_that_update_only(tmp_path, warm_cache):
    cfg = make_cfg(
        [
            "++advantage._target_=helpers.NaNOnCalls",
            "++advantage.calls=[2]",
            "steps=3",
            "checkpoint.keep=5",
            "loss.beta=0",
        ],
        cache_dir=warm_cache,
    )
    run(cfg, str(tmp_path))
    lines = metrics(tmp_path)
    assert lines[2].get("train/nonfinite_skipped") == 1 and "train/loss" not in lines[2]
    assert "train/skipped_empty_batch" not in lines[2] and lines[2]["train/adv_mean"] == "nan"  # rollout still logged
    assert "train/nonfinite_skipped" not in lines[1] and "train/nonfinite_skipped" not in lines[3]
    w1, w2, w3 = (policy_weights(tmp_path, s) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # step 2 changed nothing
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # step 3 trained again
    assert all(torch.isfinite(v).all() for v in w3.values())


def test_too_many_nans_in_a_row_stop_the_run_and_keep_the_good_checkpoint(tmp_path, warm_cache):
    cfg = make_cfg(
        [
            "++advantage._target_=helpers.NaNOnCalls",
            "++advantage.calls=[3,4,5,6]",
            "steps=6",
            "optim.max_nonfinite=2",
            "checkpoint.keep=9",
        ],
        cache_dir=warm_cache,
    )
    with pytest.raises(NonFiniteError, match="2 non-finite updates in a row \\(last at step 4\\)"):
        run(cfg, str(tmp_path))
    good, after = policy_weights(tmp_path, 2), policy_weights(tmp_path, 4)
    assert all(torch.equal(good[k], after[k]) and torch.isfinite(after[k]).all() for k in good)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]


def file_task(tmp_path, train, evals=GOOD):
    return [
        "task=files",
        f"task.train_path={write_jsonl(tmp_path / 'train.jsonl', train)}",
        f"task.eval_path={write_jsonl(tmp_path / 'eval.jsonl', evals)}",
    ]


@pytest.mark.parametrize(
    "train, message",
    [
        (GOOD + [{"prompt": "4+4="}], r"task.train row 2 \('4\+4='\) has no answer"),
        (GOOD + [{"prompt": "", "answer": "1"}], r"task.train row 2 has no prompt"),
        ([{"question": "1+1=", "answer": "2"}], r"task.train has no 'prompt' column"),
    ],
)
def test_bad_rows_are_reported_before_training(tmp_path, train, message):
    with pytest.raises(TaskError, match=message):
        run(make_cfg(file_task(tmp_path, train)), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_file_task_trains_from_files_it_loads(tmp_path, warm_cache):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    summary = run(make_cfg(file_task(tmp_path, rows, rows[:4]), cache_dir=warm_cache), str(tmp_path / "run"))
    assert summary["steps"] == 2 and 0 <= summary["accuracy_after"] <= 1


def test_empty_split_is_reported(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TaskError, match="task.eval|empty|cannot load"):
        run(
            make_cfg(file_task(tmp_path, GOOD)[:2] + [f"task.eval_path={tmp_path / 'empty.jsonl'}"]),
            str(tmp_path / "r"),
        )


def test_reward_function_that_raises_names_row_and_completion(tmp_path, warm_cache, monkeypatch):
    import helpers
    from rlkit.tasks.arithmetic import Arithmetic

    monkeypatch.setattr(Arithmetic, "reward", staticmethod(helpers.raising_reward))
    with pytest.raises(
        TaskError, match=r"reward function raised on row \d+ \(prompt '.*', completion '1.*'\): KeyError"
    ):
        run(make_cfg(["steps=3", "warm_start.steps=0", "rollout.temperature=2.0"], cache_dir=warm_cache), str(tmp_path))


def test_reward_that_is_not_a_number_is_reported(tmp_path, warm_cache, monkeypatch):
    from rlkit.tasks.arithmetic import Arithmetic

    monkeypatch.setattr(Arithmetic, "reward", lambda self, row, text: "yes")
    with pytest.raises(TaskError, match=r"reward function returned 'yes' for row 0"):
        run(make_cfg([], cache_dir=warm_cache), str(tmp_path))


def test_prompt_longer_than_the_context_is_reported(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"task.train row \d+ has a prompt of 4 tokens; with "
        r"rollout.max_new_tokens=12 it exceeds the model's context of 10",
    ):
        run(make_cfg(["++model.max_position_embeddings=10"]), str(tmp_path))


def test_unwritable_output_directory_is_reported(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="hydra.run.dir: directory .* is not writable"):
        run(make_cfg([]), str(tmp_path / "file" / "run"))


def test_micro_batches_need_not_divide_the_batch(tmp_path, warm_cache):
    whole = run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path / "a"))
    split = run(make_cfg(["steps=1", "optim.micro_batch_size=5"], cache_dir=warm_cache), str(tmp_path / "b"))
    a, b = metrics(tmp_path / "a")[1], metrics(tmp_path / "b")[1]
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)
    assert whole["accuracy_after"] == split["accuracy_after"]


def test_same_seed_same_config_same_metrics(tmp_path, warm_cache):
    for name in ("a", "b"):
        run(make_cfg(["steps=3", "optim.epochs=2", "algo=ppo"], cache_dir=warm_cache), str(tmp_path / name))
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")


FUZZ = {
    "steps": [1, 2, 0, -1, "x"],
    "rollout.group_size": [1, 2, 3, 0],
    "rollout.prompts_per_step": [1, 2, 0],
    "rollout.max_new_tokens": [1, 6, 0, -3, 500],
    "rollout.temperature": [0.5, 1.5, 0, -1],
    "rollout.top_p": [0.5, 1.0, 0, 1.5],
    "loss.eps_low": [0.1, 1.0, -0.1],
    "loss.eps_high": [0.28, -1],
    "loss.beta": [0, 0.04, -0.1],
    "loss.kl_estimator": ["k1", "k2", "k3", "k9"],
    "loss.kl_placement": ["loss", "reward", "both"],
    "loss.dual_clip": ["null", 3.0, 0.5],
    "loss.entropy_coef": [0, 0.01],
    "optim.lr": [1e-3, 0, -1],
    "optim.epochs": [1, 2, 0],
    "optim.mini_batches": [1, 2, 5, 0],
    "optim.micro_batch_size": [0, 3, -1],
    "optim.max_grad_norm": [1.0, 0],
    "reward.overlong_cache": [0, 2, 100, -1],
    "advantage": ["grpo", "dr_grpo", "rloo", "gae", "process", "nope"],
    "aggregator": ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "nope"],
    "sampler": ["uniform", "dapo", "nope"],
    "algo": ["grpo", "dr_grpo", "dapo", "rloo", "ppo", "nope"],
    "+advantage.bogus": [1],
    "model.num_heads": [2, 3],
    "task.n_eval": [4, 0, 10000],
}
CLEAN = (ConfigError, TaskError, ConfigCompositionException, HydraException, OmegaConfBaseException)
FUZZ_COUNTS = {"ran": 0, "clean_error": 0}


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(sorted(FUZZ)), st.integers(0, 10), min_size=1, max_size=4))
def test_fuzzed_overrides_run_or_fail_with_a_clear_error(tmp_path_factory, warm_cache, picks):
    overrides = [f"{k}={FUZZ[k][i % len(FUZZ[k])]}" for k, i in picks.items()]
    run_dir = tmp_path_factory.mktemp("fuzz")
    try:
        run(make_cfg(["steps=1", *overrides], cache_dir=warm_cache), str(run_dir))
        FUZZ_COUNTS["ran"] += 1
    except CLEAN as e:
        assert str(e), overrides
        FUZZ_COUNTS["clean_error"] += 1
    print(f"fuzz: {FUZZ_COUNTS}")


FIELDS = ["1+1=", "2+3=", "é+1=", "", "12", 7, 3.5, None, "ü"]


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(["ok", "n", "n1", "pg", "raise"]),
    st.lists(st.tuples(st.sampled_from(FIELDS), st.sampled_from(FIELDS)), min_size=1, max_size=4),
)
def test_fuzzed_plugins_and_data_files_run_or_fail_with_rlkits_message(tmp_path_factory, shape, rows):
    """Plugin estimators with wrong output shapes, and data files with numeric, empty and non-ASCII
    fields: each example runs or stops with rlkit's own error, never a traceback from deep inside."""
    run_dir = tmp_path_factory.mktemp("fuzz")
    data = [{"prompt": p, "answer": a} for p, a in rows]
    plugin = (
        []
        if shape == "ok"
        else [
            "++advantage._target_=helpers.WrongShape",
            f"++advantage.shape={shape}",
            "~advantage.std",
            "~advantage.eps",
            "~advantage.std_scope",
        ]
    )
    try:
        run(make_cfg(["steps=1", *plugin, *file_task(run_dir, data + GOOD, data)]), str(run_dir / "run"))
        assert shape == "ok"
    except (ConfigError, TaskError) as e:
        assert str(e)
