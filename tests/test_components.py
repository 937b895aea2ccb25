"""Components behind their Protocols: the engine is the only way to generate, a plugin loss runs
through hydra.searchpath, and a component missing a declared attribute is named."""

import json

import pytest
import torch
from test_variants import cli

import helpers
from conftest import make_cfg
from helpers import write_plugin
from rlkit.loop import collect, prepare_and_update
from rlkit.refusals import ConfigError
from rlkit.session import run
from rlkit.setup import setup, validate


def prepared(cfg, tmp_path):
    state = setup(cfg, str(tmp_path), {})
    rollout, _ = collect(state)
    return state, rollout


def test_an_engine_with_its_own_numbers_gets_old_logprobs_recomputed_and_weights_synced(tmp_path, warm_cache):
    cfg = make_cfg(
        ["loss.beta=0", "++engine._target_=helpers.RemoteLikeEngine", "checkpoint.every=0"], cache_dir=warm_cache
    )
    state, rollout = prepared(cfg, tmp_path / "a")
    before, synced = helpers.RemoteLikeEngine.syncs, state.parts.engine.model.model.embed_tokens.weight.clone()
    batch, _ = prepare_and_update(state, rollout)
    assert batch.old_logp is not None and batch.old_logp.shape == batch.adv.shape
    assert helpers.RemoteLikeEngine.syncs == before + 1
    assert torch.equal(state.parts.engine.model.model.embed_tokens.weight, state.parts.policy.model.embed_tokens.weight)
    assert not torch.equal(synced, state.parts.policy.model.embed_tokens.weight)  # the update moved the weights
    own, own_rollout = prepared(make_cfg(["loss.beta=0"], cache_dir=warm_cache), tmp_path / "b")
    assert (
        prepare_and_update(own, own_rollout)[0].old_logp is None
    )  # the trainer's own engine: old log-probs come free from the update


def test_a_run_generates_only_through_its_engine(tmp_path, warm_cache):
    before = helpers.RemoteLikeEngine.generations
    run(
        make_cfg(["++engine._target_=helpers.RemoteLikeEngine", "steps=2"], cache_dir=warm_cache), str(tmp_path / "run")
    )
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["train/ratio_dev"] == pytest.approx(0.0, abs=1e-6)  # recomputed old log-probs match
    assert "eval/accuracy" in lines[2]
    # 2 training rollouts and 3 evaluations (steps 0, 1, 2; 8 held-out prompts fit one batch)
    assert helpers.RemoteLikeEngine.generations - before == 5


def test_a_component_missing_a_declared_attribute_is_named():
    with pytest.raises(
        ConfigError,
        match=r"advantage: OldStylePlugin lacks data_parallel, needs_policy_stats, needs_step_rewards .*subclass it",
    ):
        validate(make_cfg(["++advantage._target_=helpers.OldStylePlugin"]))


@pytest.mark.slow
def test_plugin_loss_by_hydra_searchpath(tmp_path):
    """A new loss is a class plus a YAML: vanilla policy gradient, -ratio * A, with its own statistic."""
    pkg, conf = write_plugin(
        tmp_path / "src",
        "my_losses",
        "import torch\n"
        "from rlkit.losses import Regularised\n\n"
        "class VanillaPG(Regularised):\n"
        "    def surrogate(self, logp, old_logp, adv, mask):\n"
        "        ratio = torch.exp(logp - old_logp)\n"
        "        return -ratio * adv, {'pos_adv_frac': (adv > 0).float()}\n",
        "loss",
        "vpg",
        "_target_: my_losses.VanillaPG\nbeta: 0.0\n",
    )
    out = cli(["loss=vpg", f"hydra.searchpath=[file://{conf}]"], tmp_path / "run", PYTHONPATH=str(pkg))
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 <= line["train/pos_adv_frac"] <= 1 and "train/loss" in line
