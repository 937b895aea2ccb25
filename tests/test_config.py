"""Real Hydra composition of the packaged config; bad input fails early with the key named."""

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conftest import make_cfg
from rlkit.refusals import ConfigError
from rlkit.session import run
from rlkit.setup import validate


def test_defaults_compose_and_validate():
    cfg = make_cfg()
    validate(cfg)
    assert cfg.advantage._target_ == "rlkit.advantages.GRPO" and cfg.loss.beta == 0.04


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(ConfigCompositionException, match=r"(?s)advantage/nope.*Available options.*grpo"):
        make_cfg(["advantage=nope"])


def test_misspelled_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as e:
        make_cfg(["rollout.grup_size=4"])
    assert "grup_size" in str(e.value) + str(e.value.__cause__)


def test_wrong_type_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        make_cfg(["steps=many"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.group_size=1", r"rollout.group_size >= 2"),
        ("optim.lr=0", r"optim.lr must be > 0"),
        ("optim.eps=0", r"optim.eps must be > 0"),
        ("optim.lr=-1e-3", r"optim.lr must be > 0"),
        ("steps=0", r"steps must be >= 1"),
        ("rollout.max_new_tokens=0", r"rollout.max_new_tokens must be >= 1"),
        ("loss.kl_estimator=k4", r"loss.kl_estimator must be one of k1, k2, k3"),
        ("+advantage.bogus=1", r"advantage.bogus is not an option of rlkit.advantages.GRPO"),
        ("advantage.std=median", r"advantage.std must be 'sample' or 'population'"),
    ],
)
def test_bad_values_are_named(override, message, tmp_path):
    cfg = make_cfg([override])
    with pytest.raises(ConfigError, match=message):
        run(cfg, str(tmp_path))  # fails in validate(), before any model is built
    assert not (tmp_path / "metrics.jsonl").exists()


def test_every_bad_value_is_named_in_one_refusal_and_a_non_finite_one_alone():
    from rlkit.config import check_values

    with pytest.raises(ConfigError) as e:
        check_values(make_cfg(["optim.lr=0", "steps=0", "eval.batch_size=0"]))
    named = ["steps must be >= 1, got 0", "optim.lr must be > 0, got 0.0", "eval.batch_size must be >= 1, got 0"]
    assert str(e.value) == "; ".join(named)
    with pytest.raises(ConfigError) as e:  # not also "optim.lr must be > 0, got nan"
        check_values(make_cfg(["optim.lr=nan", "steps=0"]))
    assert str(e.value) == "optim.lr must be a finite number, got nan"


@pytest.mark.slow
def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlkit.train", "rollout.group_size=1", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "rlkit: error: advantage=rlkit.advantages.GRPO needs rollout.group_size >= 2, got 1" in out.stderr
    assert "Traceback" not in out.stderr
