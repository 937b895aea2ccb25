"""Bad numbers, bad models, bad reward functions and bad plugins are refused with one line naming the
key, the function or the file (exit 2), before anything is allocated or written; a refused run
leaves the run directory as it was. Each test fails on a build that lacks the check it names."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from cli import TESTS, command, metrics, run_cli, train, wait_for
from conftest import FAST, make_cfg
from helpers import GOOD, file_task
from rlkit.config import numbers
from rlkit.exits import EXIT_BAD_INPUT
from rlkit.refusals import ConfigError
from rlkit.session import run
from rlkit.setup import validate
from rlkit.tasks.base import TaskError

CONF = Path(__file__).resolve().parents[1] / "conf"


SKIP_GROUPS = {"hydra", "experiment"}


@functools.lru_cache(maxsize=None)
def numeric_keys() -> list[tuple[str, str]]:
    """(group option override, dotted key) for every number of every option of every group, leaving
    out an option refused on its own (it needs another setting: `rewards=reward_model` a model path,
    `environment=verifiers` the verifiers task), whose refusal names that setting, not the number."""
    out = []
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in SKIP_GROUPS):
        for option in sorted(group.glob("*.yaml")):
            choice = f"{group.name}={option.stem}"
            if refusal(choice) is not None:
                continue
            for key, _ in numbers(OmegaConf.to_container(make_cfg([choice]), resolve=True)):
                if group.name == "algo" or key.split(".")[0] in (group.name, "reward"):
                    out.append((choice, key))
    top = [("algo=grpo", k) for k, _ in numbers(OmegaConf.to_container(make_cfg(), resolve=True))]
    return sorted(set(out + top))


KEYS = st.deferred(lambda: st.sampled_from(numeric_keys()))  # composed on first use, not at collection


def refusal(choice: str, key: str | None = None, value: str = "") -> str | None:
    """What refuses `key=value` (no override without a key): Hydra's composition (a typed key; the
    CLI exits 2 with it) or `validate`; None when both accept it. Any other exception fails the test."""

    try:
        cfg = make_cfg([choice] if key is None else [choice, f"{key}={value}"])
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
        ("optim.beta2=1", "optim.beta2 must be in [0, 1), got 1.0"),
    ],
)
def test_bad_numbers_are_refused_before_anything_is_built(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        run(make_cfg([override]), str(tmp_path / "run"))
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_optimal_token_baseline_with_entropy_selection_is_refused(tmp_path):
    """Both need the old log-probs' forward to give a second statistic (sum pi^2, entropies)."""
    with pytest.raises(ConfigError) as e:
        run(make_cfg(["advantage=otb", "loss.top_entropy_quantile=0.2"]), str(tmp_path / "run"))
    assert "advantage=rlkit.group_advantages.OTB needs the old policy's sum pi^2" in str(e.value)
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


@pytest.mark.parametrize("weight", ["nan", "inf"])
def test_a_reward_weight_that_is_not_finite_is_named(tmp_path, weight):
    with pytest.raises(ConfigError, match=rf"reward.functions.format.weight must be a finite number, got {weight}"):
        run(make_cfg(["rewards=accuracy_format", f"reward.functions.format.weight={weight}"]), str(tmp_path))


def test_reward_functions_are_named_in_errors_and_numpy_numbers_are_accepted(tmp_path, warm_cache):
    def numpy_reward(*options):
        fn = "reward.functions.format"
        return make_cfg(
            ["rewards=accuracy_format", f"++{fn}._target_=helpers.NumpyReward", f"~{fn}.pattern", *options],
            cache_dir=warm_cache,
        )

    assert run(numpy_reward("steps=1"), str(tmp_path / "ok"))["steps"] == 1  # a finite np.float32 is a number
    zero_by_zero = numpy_reward("++reward.functions.format.value=0", "++reward.functions.format.divide_by=0", "steps=1")
    with pytest.raises(TaskError, match=r"reward.functions.format returned \S*nan\S* for row 0"):
        run(zero_by_zero, str(tmp_path / "nan"))
    with pytest.raises(ConfigError, match=r"reward.functions.format.value must be a finite number, got nan"):
        run(numpy_reward("++reward.functions.format.value=nan"), str(tmp_path / "nan_config"))


def test_prompt_longer_than_the_context_is_reported(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"task.train row \d+ has a prompt of 4 tokens; with "
        r"rollout.max_new_tokens=12 it exceeds the model's context of 10",
    ):
        run(make_cfg(["++model.max_position_embeddings=10"]), str(tmp_path))


def test_characters_the_tokenizer_cannot_encode_are_named(tmp_path):
    from rlkit.models import TinyQwen2
    from rlkit.tasks.arithmetic import ALPHABET

    model, tok = TinyQwen2(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64).build(
        ALPHABET, 0
    )
    tok.save_pretrained(tmp_path / "hf")
    model.save_pretrained(tmp_path / "hf")
    files = file_task(tmp_path, GOOD, GOOD + [{"prompt": "1+é=", "answer": "1"}])
    with pytest.raises(
        ConfigError, match=r"task.eval row 2 \('1\+é='\) has characters the tokenizer cannot encode: \['é'\]"
    ):
        run(make_cfg(files + ["model=pretrained", f"model.path={tmp_path / 'hf'}"]), str(tmp_path / "run"))


def test_an_evaluation_budget_past_the_context_is_named(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"task.eval row \d+ has a prompt of \d+ tokens; with "
        r"eval.max_new_tokens=200 it exceeds the model's context of 128",
    ):
        run(make_cfg(["eval.max_new_tokens=200", "warm_start.steps=0"]), str(tmp_path / "run"))


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


@pytest.mark.parametrize(
    "shape, message",
    [
        ("n", r"returned advantages of shape \(16,\); expected a float tensor of shape \[N, Tc\] = \[16, 12\]"),
        ("n1", r"returned advantages of shape \(16, 1\)"),
        ("pg", r"returned advantages of shape \(4, 4\)"),
        ("raise", r"advantage=WrongShape raised on a rollout of 16 rows: IndexError: plugin bug"),
    ],
)
def test_a_plugin_estimator_with_a_bug_is_named_before_any_update(tmp_path, shape, message, warm_cache):
    cfg = make_cfg(
        [
            "++advantage._target_=helpers.WrongShape",
            f"++advantage.shape={shape}",
            "~advantage.std",
            "~advantage.eps",
            "~advantage.std_scope",
            "rollout.max_new_tokens=12",
            "loss.beta=0",
        ],
        cache_dir=warm_cache,
    )
    with pytest.raises(ConfigError, match=message):
        run(cfg, str(tmp_path))
    assert [l["step"] for l in metrics(tmp_path)] == [0] and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("advantage.bogus=1", "Could not override 'advantage.bogus'"),
        ("+loss.eps_hi=0.3", "loss.eps_hi is not an option of rlkit.losses.PPOClip (options: ['eps_low', 'eps_high'"),
        ("model.hidden_size=abc", "model.hidden_size='abc' must be of type int"),
        ("advantage=nope", "Could not find 'advantage/nope'"),
    ],
)
@pytest.mark.slow
def test_bad_input_exits_2_with_a_message_and_leaves_no_output_folder(tmp_path, override, message):
    out = run_cli([override, "steps=1", "warm_start.steps=0"], tmp_path)
    assert out.returncode == EXIT_BAD_INPUT and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_refused_run_leaves_the_run_directorys_hydra_files_as_they_were(tmp_path, warm_cache):
    first = train(tmp_path / "run", warm_cache, "steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["hardware"]["pins"] == {}  # no pins: none named
    before = {p.name: p.read_text() for p in (tmp_path / "run" / ".hydra").iterdir()}
    refused = train(tmp_path / "run", warm_cache, "steps=1", "seed=7", "optim.lr=0.5")
    assert (
        refused.returncode == EXIT_BAD_INPUT
        and "written with different optim.lr (0.0001 -> 0.5), seed (0 -> 7)" in refused.stderr
    )
    assert {p.name: p.read_text() for p in (tmp_path / "run" / ".hydra").iterdir()} == before


@pytest.mark.slow
def test_a_refused_run_removes_only_the_folders_it_created(tmp_path):
    (tmp_path / "mine" / "empty").mkdir(parents=True)
    out = run_cli(["steps=0", "hydra.run.dir=mine/empty/run"], cwd=tmp_path, timeout=120)
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-2000:]
    assert (tmp_path / "mine" / "empty").is_dir() and not (tmp_path / "mine" / "empty" / "run").exists()


def snapshot(folder: Path) -> dict:
    """Every file under `folder` by relative name, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_run_refused_for_a_live_directory_touches_nothing_of_the_live_run(tmp_path, warm_cache):
    run_dir, go = tmp_path / "run", tmp_path / "go"
    held = ["++reward.functions.wait._target_=helpers.WaitsForFile", f"++reward.functions.wait.path={go}"]
    env = {**os.environ, "PYTHONPATH": TESTS}
    live = subprocess.Popen(command(run_dir, warm_cache, *held), stderr=subprocess.PIPE, text=True, env=env)
    try:  # the live run has claimed the directory, Hydra has written its files, and set-up waits on `go`
        wait_for(lambda: Path(f"{go}.waiting").exists(), live)
        before = snapshot(run_dir)
        assert {".hydra/config.yaml", ".rlkit.lock", "train.log"} <= set(before)
        for extra in (["seed=5"], ["steps=0"]):  # a run that would train, and one that is bad input
            refused = train(run_dir, warm_cache, *extra)
            assert refused.returncode == EXIT_BAD_INPUT, refused.stderr[-3000:]
            assert f"in use by a live run (pid {live.pid})" in refused.stderr
            assert snapshot(run_dir) == before  # its .hydra, log and lock as the live run wrote them
        go.touch()
        assert live.wait(timeout=300) == 0, live.stderr.read()[-3000:]
    finally:
        live.kill()
    assert [l["step"] for l in metrics(run_dir)] == [0, 1, 2]  # one run's steps, each once
    assert "seed: 0" in (run_dir / ".hydra" / "config.yaml").read_text()


@pytest.mark.parametrize("key", ["reward.functions.x", "loss", "aggregator", "correction"])
def test_a_target_that_is_not_a_component_is_refused_before_it_is_built(tmp_path, key):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    zip_file = [f"++{key}._target_=zipfile.ZipFile", f"++{key}.file={victim}", f"++{key}.mode=w"]
    with pytest.raises(ConfigError, match=rf"{key}: zipfile.ZipFile does not implement \w+ \(it lacks"):
        validate(make_cfg(zip_file))
    assert victim.read_text() == "precious"  # ZipFile(file, mode="w") would have emptied it


@pytest.mark.parametrize(
    "overrides",
    [
        ["environment=calculator", "environment.preamble=[{_target_:logging.FileHandler,filename:pwned.txt}]"],
        ["+environment.preamble=[{_target_:logging.FileHandler,filename:pwned.txt}]"],
        ["+advantage.extra={_target_:logging.FileHandler,filename:pwned.txt}"],
        ["+stray={_target_:logging.FileHandler,filename:pwned.txt}"],
    ],
)
def test_a_target_below_a_component_is_refused_before_anything_is_built(tmp_path, overrides):
    """A `_target_` inside a list option, a component's nested option or any other key is named and
    refused (exit 2) before any constructor runs: `logging.FileHandler` would create the file."""
    done = run_cli([*FAST, "hydra.run.dir=run", *overrides], cwd=tmp_path, timeout=120)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert "_target_: a _target_ names a class only at the top of a component" in done.stderr
    assert not (tmp_path / "pwned.txt").exists()
    assert not (tmp_path / "run").exists()  # the refused run undid its claim


@pytest.mark.parametrize("added", ["+optim.lrr=0.1", "+bogus=1", "+eval.sample=4"])
def test_a_key_added_with_plus_that_rlkit_does_not_have_is_refused(added):
    """Hydra lets `+` add any key; one rlkit does not read (a misspelling) was once kept silently in
    run.json and ignored."""
    key = added[1:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"unknown key\(s\) {re.escape(key)}: not in rlkit's config"):
        validate(make_cfg([added]))
