"""Fuzzed input (hypothesis): overrides, plugins, data files, reward functions, model paths and
math files either run or fail with rlkit's own message, never a traceback from deep inside."""

import shutil

import pytest
from hydra.errors import ConfigCompositionException, HydraException
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException

from conftest import make_cfg
from helpers import GOOD, file_task
from rlkit.refusals import ConfigError
from rlkit.session import run
from rlkit.tasks.base import TaskError

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


FIELDS = ["1+1=", "2+3=", "é+1=", "", "12", 7, 3.5, None, "ü"]


FUZZ_SEEN = []


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
