"""Which checkpoint resumes which run: every option of every group and every key of the config is
compared (only where it runs, what it logs, when it evaluates or checkpoints, and how long it runs
may change), `steps` cannot fall below the checkpoint's step, the task's rows must be the ones it
trained on, and temporary files of writers that died are removed."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_cfg
from helpers import GOOD, file_task, write_jsonl
from rlkit.checkpoint import MAY_CHANGE, check_resume
from rlkit.config import resolved
from rlkit.refusals import ConfigError
from rlkit.session import run

CONF = Path(__file__).parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "experiment"))
OPTIONS = [(g, o.stem) for g in GROUPS for o in sorted((CONF / g).glob("*.yaml"))]
DEFAULT = resolved(make_cfg([]))


def leaves(node, prefix=""):
    """{dotted key: value} of every leaf of a resolved config (worked out here, not by rlkit)."""
    if not isinstance(node, dict) or not node:
        return {prefix.rstrip("."): node}
    return {k: v for key, child in node.items() for k, v in leaves(child, f"{prefix}{key}.").items()}


def may_change(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in MAY_CHANGE)


def refusal(saved: dict, now: dict) -> str | None:
    try:
        check_resume(saved, now, "ckpt")
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("group, option", OPTIONS)
def test_every_option_of_every_group_resumes_only_the_run_that_chose_it(group, option):
    now = resolved(make_cfg([f"{group}={option}"]))
    a, b = leaves(DEFAULT), leaves(now)
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not may_change(k))
    message = refusal(DEFAULT, now)
    if group == "logger":  # where metrics go may change
        assert not differ and message is None
    else:  # any other option than the default's is refused, naming what it changed
        assert bool(differ) == (now != DEFAULT) == (message is not None), (group, option, message)
        assert not differ or any(k.split(".")[0] in message for k in differ), (message, differ)
    assert refusal(now, now) is None


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_changing_any_key_is_refused_naming_it_unless_it_may_change(data):
    flat = leaves(DEFAULT)
    key = data.draw(st.sampled_from(sorted(flat)))
    old = flat[key]
    new = data.draw(st.sampled_from([f"{old}_changed", 12345, None, [1, 2]]).filter(lambda v: v != old))
    now = json.loads(json.dumps(DEFAULT))
    node = now
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    node[last] = new
    message = refusal(DEFAULT, now)
    if may_change(key):
        assert message is None, (key, message)
    else:
        assert message is not None and key.rsplit("._target_", 1)[0] in message, (key, message)


def test_a_resume_names_each_changed_key_with_both_values(warm_cache):
    saved = resolved(make_cfg(["engine=off_policy", "engine.staleness=1"], cache_dir=warm_cache))
    now = resolved(make_cfg(["engine=off_policy", "engine.staleness=4", "engine.dtype=bfloat16"], cache_dir=warm_cache))
    message = refusal(saved, now)
    assert "engine.dtype ('float32' -> 'bfloat16')" in message and "engine.staleness (1 -> 4)" in message
    message = refusal(DEFAULT, resolved(make_cfg(["correction=tis"])))
    assert "correction (rlkit.corrections.NoCorrection -> rlkit.corrections.TokenTIS)" in message
    moved = resolved(make_cfg(["steps=9", "eval.every=5", "checkpoint.every=3", "device=cpu", "logger=wandb"]))
    assert refusal(DEFAULT, moved) is None


def test_a_run_resumed_with_another_correction_or_engine_is_refused_and_trains_on_when_it_is_the_same(
    tmp_path, warm_cache
):
    first = run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path))
    for changed, key in (
        (["correction=tis"], "correction"),
        (["engine=off_policy"], "engine"),
        (["engine=off_policy", "engine.staleness=4", "engine.dtype=bfloat16"], "engine"),
        (["advantage=gae"], "advantage"),
    ):
        with pytest.raises(ConfigError, match=f"written with different {key}"):
            run(make_cfg(["steps=3", *changed], cache_dir=warm_cache), str(tmp_path))
    with pytest.raises(ConfigError, match=r"steps=1 is below the step of the checkpoint .* \(2\); give steps >= 2"):
        run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text()) == first  # the refusals changed nothing
    assert run(make_cfg(["steps=3"], cache_dir=warm_cache), str(tmp_path))["steps"] == 3


def test_a_run_whose_data_changed_is_refused_naming_the_split(tmp_path, warm_cache):
    task = file_task(tmp_path, GOOD * 4)
    run(make_cfg([*task, "steps=1", "warm_start.steps=0"]), str(tmp_path / "run"))
    write_jsonl(tmp_path / "train.jsonl", [*GOOD * 4, {"prompt": "9+9=", "answer": "18"}])  # a new character too
    with pytest.raises(ConfigError, match="the task's train rows differ from those the checkpoint .* was trained on"):
        run(make_cfg([*task, "steps=2", "warm_start.steps=0"]), str(tmp_path / "run"))
    write_jsonl(tmp_path / "train.jsonl", GOOD * 4)  # the same rows again: it resumes
    assert run(make_cfg([*task, "steps=2", "warm_start.steps=0"]), str(tmp_path / "run"))["steps"] == 2


def test_temporary_files_of_writers_that_died_are_removed_on_resume(tmp_path, warm_cache):
    run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path))
    stale = [tmp_path / "checkpoints" / ".tmp_step_000002.999999", tmp_path / f".tmp_run.json.{os.getpid() + 1}"]
    stale[0].mkdir()
    (stale[0] / "model.safetensors").write_bytes(b"x" * 1000)
    stale[1].write_text("{")
    run(make_cfg(["steps=2"], cache_dir=warm_cache), str(tmp_path))
    assert not any(p.exists() for p in stale)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_a_checkpoint_from_before_environments_resumes_single_turn_runs_only():
    older = {k: v for k, v in DEFAULT.items() if k != "environment"}  # what runs before the group wrote
    assert refusal(older, DEFAULT) is None
    message = refusal(older, resolved(make_cfg(["environment=calculator"])))
    assert message is not None and "environment" in message


def test_a_checkpoint_from_before_the_calculators_error_reward_resumes_runs_without_one():
    now = resolved(make_cfg(["environment=calculator"]))
    older = {**now, "environment": {k: v for k, v in now["environment"].items() if k != "error_reward"}}
    assert refusal(older, now) is None
    termed = resolved(make_cfg(["environment=calculator", "environment.error_reward=-0.1"]))
    message = refusal(older, termed)
    assert message is not None and "environment.error_reward (0.0 -> -0.1)" in message
