"""Every algo preset and every group option composes and runs two steps; the plugin route works."""

import json
from pathlib import Path

import pytest

from cli import run_cli
from conftest import make_cfg
from helpers import SIGN_ONLY, write_plugin
from rlkit.session import run

CONF = Path(__file__).parents[1] / "conf"
PLUGINS = Path(__file__).parents[1] / "experiments" / "plugins"


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_the_documented_options():
    assert options("advantage") == [
        "dr_grpo",
        "gae",
        "gpg",
        "grpo",
        "krpo",
        "maxrl",
        "opo",
        "otb",
        "passk",
        "process",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "rloo",
    ]
    assert options("aggregator") == [
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
        "token_mean",
    ]
    assert options("sampler") == ["dapo", "uniform"]
    assert options("algo") == [
        "dapo",
        "dppo",
        "dr_grpo",
        "gpg",
        "grpo",
        "luspo",
        "maxrl",
        "ppo",
        "reinforce_pp",
        "rloo",
    ]
    assert options("loss") == [
        "aspo",
        "bapo",
        "ce_gppo",
        "cispo",
        "clip_cov",
        "dppo",
        "dro",
        "gmpo",
        "gspo",
        "kimi",
        "kl_cov",
        "pg",
        "ppo_clip",
        "sapo",
        "topr",
        "vespo",
    ]
    assert options("correction") == ["m2po", "mis", "none", "opsm", "seq_mis", "seq_tis", "tis"]
    assert options("engine") == ["kv_cache", "off_policy"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warm"))


OFF_POLICY = "engine=off_policy engine.staleness=1 engine.dtype=bfloat16 optim.mini_batches=2"  # corrections act
CASES = (
    [f"algo={a}" for a in options("algo")]
    + [f"{g}={o}" for g in ("advantage", "aggregator", "sampler", "loss") for o in options(g)]
    + [f"correction={o} {OFF_POLICY}" for o in options("correction")]
)


DEFAULTS = {
    "algo=grpo",
    "advantage=grpo",
    "aggregator=seq_mean_token_mean",
    "sampler=uniform",
    "loss=ppo_clip",
    f"correction=none {OFF_POLICY}",
}  # what the default config (or the corrections' baseline) already is


def two_steps(overrides: str, cache: str, run_dir: Path) -> list[dict]:
    summary = run(make_cfg([*overrides.split(), "eval.every=0", "checkpoint.every=0"], cache_dir=cache), str(run_dir))
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2] and summary["steps"] == 2
    assert all("train/loss" in l or "train/skipped_empty_batch" in l for l in lines[1:])
    return lines


def update_numbers(lines: list[dict]) -> list:
    """What each step's update was: its loss and gradient norm (a skipped step: None)."""
    return [(l.get("train/loss"), l.get("train/grad_norm")) for l in lines[1:]]


# options that act only under a condition the small default run may not meet, and that condition:
# dynamic sampling needs a group without signal (likelier with 2 completions), KL-Cov's penalty is 0
# at the first update of a rollout (logp = old logp), and the sequence mask needs a sequence past delta,
# as DPPO's token mask needs a token past delta, CE-GPPO a clipped token and ASPO a ratio off 1 (else each
# is PPO at ratio 1)
ENGAGE = {
    "sampler=dapo": "rollout.group_size=2",
    "loss=kl_cov": "optim.mini_batches=2",
    "loss=dppo": "optim.mini_batches=2",
    "loss=ce_gppo": "optim.mini_batches=2",
    "loss=aspo": "optim.mini_batches=2",  # at ratio 1 the flipped weight 1/r is PPO's r
    "loss=bapo": "optim.mini_batches=2",  # at ratio 1 any bounds give PPO's gradient
}
OWN_OPTION = {
    f"correction=opsm {OFF_POLICY}": "correction.delta=0",
    f"correction=m2po {OFF_POLICY}": "correction.threshold=1e-6",  # a bf16 engine's (log rho)^2 is about 4e-5
    "loss=dppo": "loss.delta_low=1e-3 loss.delta_high=1e-3",
    "loss=ce_gppo": "loss.eps_low=1e-4 loss.eps_high=1e-4",
    "loss=aspo": "loss.eps_low=1e-4 loss.eps_high=1e-4 loss.eps_low_forking=1e-4 loss.eps_high_forking=1e-4",
    "loss=bapo": "loss.low=1.0 loss.low_max=1.0 loss.high=1.0 loss.high_max=1.0",
}


@pytest.fixture(scope="module")
def baseline(cache, tmp_path_factory):
    """The update numbers of the default config plus `extra` (each computed once)."""
    done = {}

    def numbers(extra: str) -> list:
        if extra not in done:
            done[extra] = update_numbers(two_steps(extra, cache, tmp_path_factory.mktemp("base")))
        return done[extra]

    return numbers


@pytest.mark.parametrize("overrides", CASES)
def test_each_option_runs_two_steps_and_acts(overrides, cache, baseline, tmp_path):
    """Same seed, same warm start: an option that is already the default gives the baseline's very
    numbers, and every other option changes the update (so one that silently does nothing fails)."""
    extra = ENGAGE.get(overrides, "")
    mine = update_numbers(two_steps(f"{overrides} {extra} {OWN_OPTION.get(overrides, '')}", cache, tmp_path))
    base = baseline(f"correction=none {OFF_POLICY}" if OFF_POLICY in overrides else extra)
    assert (mine == base) == (overrides in DEFAULTS), (overrides, mine, base)


def test_presets_set_their_papers_values():
    dapo = make_cfg(["algo=dapo"])
    assert (dapo.loss.eps_high, dapo.loss.beta, dapo.aggregator._target_) == (0.28, 0.0, "rlkit.aggregators.TokenMean")
    assert make_cfg(["algo=dr_grpo"]).aggregator.constant == make_cfg([]).rollout.max_new_tokens
    ppo = make_cfg(["algo=ppo"])
    assert ppo.advantage._target_ == "rlkit.advantages.GAE" and ppo.loss.kl_placement == "reward"
    assert make_cfg(["algo=dapo", "advantage=rloo"]).advantage._target_ == "rlkit.advantages.RLOO"  # CLI wins


def test_ppo_logs_critic_metrics(cache, tmp_path):
    run(make_cfg(["algo=ppo", "rollout.group_size=1"], cache_dir=cache), str(tmp_path))
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert "train/value_loss" in line and "train/explained_variance" in line
    assert (tmp_path / "checkpoints" / "step_000002" / "critic" / "config.json").exists()


def test_dynamic_sampling_with_groups_of_one_is_refused_early(tmp_path):
    from rlkit.refusals import ConfigError

    with pytest.raises(ConfigError, match="sampler=rlkit.samplers.DynamicSampling needs rollout.group_size >= 2"):
        run(make_cfg(["algo=ppo", "sampler=dapo", "rollout.group_size=1"]), str(tmp_path))


def cli(args, tmp_path, **env):
    return run_cli(
        [
            *args,
            "steps=1",
            "warm_start.steps=0",
            "eval.every=0",
            "logger=jsonl",
            "task.n_train=32",
            "task.n_eval=8",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "model.num_layers=1",
            f"hydra.run.dir={tmp_path}",
        ],
        env=env,
    )


@pytest.mark.slow
def test_installed_style_plugin_is_found_by_its_search_path_plugin(tmp_path):
    out = cli(["advantage=batch_std_baseline"], tmp_path, PYTHONPATH=str(PLUGINS))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "BatchStdBaseline" in (tmp_path / ".hydra" / "config.yaml").read_text()


@pytest.mark.slow
def test_plugin_by_hydra_searchpath(tmp_path):
    """The README's 'Write a plugin' example, written out by the test."""
    pkg, conf = write_plugin(
        tmp_path / "src", "my_estimators", SIGN_ONLY, "advantage", "sign", "_target_: my_estimators.SignOnly\n"
    )
    out = cli(["advantage=sign", f"hydra.searchpath=[file://{conf}]"], tmp_path / "run", PYTHONPATH=str(pkg))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])["train/num_rows"] == 4


def test_dynamic_sampling_that_keeps_nothing_skips_the_update_without_crashing(tmp_path):
    # a tiny nucleus (greedy) gives a group G equal completions: no group is informative
    run(make_cfg(["sampler=dapo", "sampler.max_gen_batches=2", "rollout.top_p=1e-6"]), str(tmp_path))
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["train/skipped_empty_batch"] for l in lines[1:]] == [1, 1]
    assert [l["sampler/gen_batches"] for l in lines[1:]] == [2, 2]
    # nothing kept: the kept groups' reward is missing, the reward of everything generated is not
    assert all("train/reward" not in l and 0 <= l["train/reward_all"] <= 1 for l in lines[1:])
    assert (tmp_path / "checkpoints" / "step_000002" / "policy").exists()
