"""The off-policy engine: its copy of the policy is exactly k updates old (read back from the
checkpoints), a resumed run lags as the uninterrupted one, a bf16 engine's numbers differ from
the trainer's while a float32 one's agree to float rounding, and evaluation sees the trainer's
current weights."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_cfg
from rlkit.engines import OffPolicy
from rlkit.models import TinyQwen2
from rlkit.refusals import ConfigError
from rlkit.session import run

TIMING = ("time/", "perf/")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warm"))


def metrics(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in l.items() if not k.startswith(TIMING)} for l in lines]


def test_the_copy_holds_the_policy_k_updates_old():
    policy, tok = TinyQwen2(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32).build(
        "0123+=", 0
    )
    engine = OffPolicy(policy, tok, staleness=2, dtype="bfloat16")
    assert engine.latest().policy is policy and next(engine.copy.parameters()).dtype == torch.bfloat16
    versions = [{k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()}]
    for u in range(1, 6):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * u)
        versions.append({k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()})
        engine.load_weights(policy)
        held = engine.copy.state_dict()
        assert all(torch.equal(held[k], versions[max(0, u - 2)][k]) for k in held), u
        assert engine.lag == min(u, 2)
    restored = OffPolicy(policy, tok, staleness=2, dtype="bfloat16")
    restored.load_state_dict(engine.state_dict())
    restored.load_weights(policy)  # the queue came back too: the next version loaded is update 4's
    assert all(torch.equal(restored.copy.state_dict()[k], versions[4][k]) for k in held)


def test_impossible_settings_are_refused():
    policy, tok = TinyQwen2(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32).build(
        "01", 0
    )
    for kw, msg in (({"staleness": -1}, "engine.staleness"), ({"dtype": "int8"}, "engine.dtype")):
        with pytest.raises(ConfigError, match=msg):
            OffPolicy(policy, tok, **kw)


def test_a_stale_engine_samples_the_weights_of_k_updates_ago_and_resumes_them(tmp_path, cache):
    over = [
        "steps=5",
        "engine=off_policy",
        "engine.staleness=2",
        "engine.dtype=bfloat16",
        "correction=tis",
        "checkpoint.keep=5",
    ]
    run_dir = tmp_path / "run"
    run(make_cfg(over, cache_dir=cache), str(run_dir))
    ckpt = run_dir / "checkpoints"
    engine = torch.load(ckpt / "step_000005" / "trainer_state.pt", weights_only=True)["engine"]
    assert (engine["version"], engine["trainer_version"], len(engine["queue"])) == (3, 5, 2)
    policy_3 = load_file(ckpt / "step_000003" / "policy" / "model.safetensors")
    assert all(torch.equal(engine["weights"][k], policy_3[k].to(torch.bfloat16)) for k in policy_3)
    first = metrics(run_dir)
    assert [l["offpolicy/lag"] for l in first[1:]] == [0, 1, 2, 2, 2]
    assert all(l["offpolicy/k3"] > 0 and l["offpolicy/abs_log_ratio"] > 1e-3 for l in first[1:])  # bf16 vs float32
    assert "train/is_clipped" in first[1]
    # stopped after step 3's checkpoint: the rerun resumes the lagging copy and its queue
    for step in (4, 5):
        shutil.rmtree(ckpt / f"step_{step:06d}")
    run(make_cfg(over, cache_dir=cache), str(run_dir))
    assert metrics(run_dir) == first


def test_a_float32_engine_agrees_with_the_trainer_to_float_rounding(tmp_path, cache):
    run(make_cfg(["steps=2", "engine=off_policy"], cache_dir=cache), str(tmp_path / "f32"))
    lines = metrics(tmp_path / "f32")[1:]
    # the KV-cache decoder sums in another order than the trainer's full forward: ~1e-7, not bitwise 0
    assert all(
        l["offpolicy/lag"] == 0
        and l["offpolicy/abs_log_ratio"] < 1e-5
        and abs(l["offpolicy/k3"]) < 1e-9
        and l["offpolicy/outside_frac"] == 0
        for l in lines
    )
    run(make_cfg(["steps=1"], cache_dir=cache), str(tmp_path / "exact"))
    assert not any(k.startswith("offpolicy/") for k in metrics(tmp_path / "exact")[1])  # the trainer's own engine


def test_the_mismatch_metrics_by_hand():
    """Four tokens with log(pi_old / mu) = 0, 0, log 2, -log 4 (a fifth masked out): ratios 1, 1, 2,
    1/4; quantiles by linear interpolation over the sorted ratios 1/4, 1, 1, 2."""
    import math

    from rlkit.metrics import mismatch_metrics

    behaviour = torch.zeros(1, 5)
    old = torch.tensor([[0.0, 0.0, math.log(2), -math.log(4), 9.0]])
    m = mismatch_metrics(old, behaviour, torch.tensor([[1, 1, 1, 1, 0]]), c_min=0.5, c_max=2.0)
    assert m["offpolicy/ratio_mean"] == pytest.approx((1 + 1 + 2 + 0.25) / 4)
    assert (m["offpolicy/ratio_min"], m["offpolicy/ratio_max"]) == pytest.approx((0.25, 2.0))
    assert m["offpolicy/log_ratio_mean"] == pytest.approx((math.log(2) - math.log(4)) / 4)
    assert m["offpolicy/abs_log_ratio"] == pytest.approx((math.log(2) + math.log(4)) / 4)
    assert m["offpolicy/ratio_p05"] == pytest.approx(0.25 + 0.15 * 0.75)  # 5% of the way: 0.15 of one gap
    assert m["offpolicy/ratio_p50"] == pytest.approx(1.0)
    assert m["offpolicy/ratio_p95"] == pytest.approx(1 + 0.85 * 1)
    assert m["offpolicy/outside_frac"] == pytest.approx(0.25)  # 1/4 below 0.5; 2 is inside [0.5, 2]
    assert m["offpolicy/k3"] == pytest.approx(((2 - 1 - math.log(2)) + (0.25 - 1 + math.log(4))) / 4)
