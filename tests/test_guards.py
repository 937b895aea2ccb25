"""Guards while a run trains: a non-finite advantage, loss or gradient skips that update and too
many in a row stop the run with its last good checkpoint; reward code past its time limit is
stopped and scored 0, and a second signal stops a hung scorer at once."""

import json
import os
import signal
import subprocess
import time
from math import inf, nan

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from cli import TESTS, command, metrics, wait_for
from conftest import make_cfg
from rlkit.checkpoint import all_finite
from rlkit.exits import EXIT_PREEMPTED
from rlkit.guards import NonFiniteError
from rlkit.session import run
from rlkit.tasks.base import TaskError


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


def test_a_math_verifier_timeout_scores_zero_and_is_counted(tmp_path):
    from rlkit.tasks.math import Math

    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 5"}) + "\n")
    task = Math(str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl"), timeout_s=1)
    assert task.reward(task.train[0], "9^9^9^9") == 0.0  # math-verify's TimeoutException is a BaseException
    assert task.step_metrics() == {"task/verify_timeouts": 1}


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


@given(
    shapes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    planted=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 39), st.sampled_from([nan, inf, -inf]))),
)
@settings(max_examples=100, deadline=None)
def test_the_checkpoint_guard_finds_any_nan_or_inf_in_any_parameter(shapes, planted):
    """`all_finite` (least and greatest value of each parameter) agrees with the elementwise
    definition, for empty parameters too, with NaN, inf and -inf planted anywhere."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for n in shapes])
    with torch.no_grad():
        for i, j, value in planted:
            if i < len(shapes) and j < shapes[i]:
                model[i][j] = value
    assert all_finite(model) == all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_checkpoint_with_a_non_finite_weight_is_refused_and_the_last_good_one_kept(tmp_path, warm_cache):
    """The policy poisoned after a checkpoint: the next `save_run` raises and writes nothing."""
    from rlkit.checkpoint import save_run
    from rlkit.setup import setup, validate
    from rlkit.signals import StopSignals

    cfg = make_cfg(["steps=2", "checkpoint.every=1"], warm_cache)
    with StopSignals() as stop:
        built = setup(cfg, str(tmp_path), {}, validate(cfg), stop)
        save_run(built, 1)
        with torch.no_grad():
            next(built.parts.policy.parameters()).view(-1)[7] = float("nan")
        with pytest.raises(NonFiniteError, match="non-finite weights at step 2; checkpoint not written"):
            save_run(built, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
