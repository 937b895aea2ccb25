"""End to end on the built-in testbed: a real tiny model, Hydra config, checkpoints."""

import json
import re

import pytest
import torch
from hydra.utils import instantiate
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli import metrics, train
from conftest import make_cfg
from rlkit.config import resolved
from rlkit.refusals import ConfigError
from rlkit.rewards import shuffled
from rlkit.session import run
from rlkit.warm_start import warm_start


def read_metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_few_steps_change_the_weights_and_write_loadable_checkpoints(fast_cfg, tmp_path):
    cfg = fast_cfg("steps=3")
    run_dir = tmp_path / "run"
    summary = run(cfg, str(run_dir))
    lines = read_metrics(run_dir)
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    for key in (
        "train/reward",
        "train/reward_std",
        "train/frac_zero_std_groups",
        "train/completion_len",
        "train/kl",
        "train/entropy",
        "train/clip_frac_low",
        "train/clip_frac_high",
        "train/clip_frac_high_of_pos",
        "train/grad_norm",
        "time/generate",
        "time/update",
        "time/step",
        "perf/tokens_per_s",
        "eval/accuracy",
        "eval/len_correct",
        "eval/len_incorrect",
        "eval/acc_d2",
        "train/acc_d2",
        "weight/share_d2",
    ):
        assert key in lines[1], key
    assert lines[1]["train/gen_tokens"] == sum(l["train/completion_len"] for l in lines[1:2]) * 16  # 4 prompts x 4
    assert summary["accuracy_before"] == lines[0]["eval/accuracy"]
    assert lines[1]["train/ratio_dev"] == 0.0  # one update per rollout: old log-probs are the update's own
    ckpt = run_dir / "checkpoints" / "step_000003" / "policy"
    model, tok = AutoModelForCausalLM.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    assert tok.decode(tok("1+2=")["input_ids"]) == "1+2="
    # the same model built and warm-started from the same config (from the cache), before RL
    task = instantiate(cfg.task)
    start, tok0 = instantiate(cfg.model).build(task.alphabet, cfg.seed)
    assert not warm_start(
        start, tok0, task, cfg.warm_start, {"model": resolved(cfg.model), "task": resolved(cfg.task)}
    )["trained"]
    moved = [not torch.equal(a, b) for a, b in zip(start.state_dict().values(), model.state_dict().values())]
    assert any(moved)
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == cfg.checkpoint.keep  # older ones pruned


def test_several_updates_per_rollout_use_stored_old_logprobs(fast_cfg, tmp_path):
    run(fast_cfg("optim.epochs=2", "optim.mini_batches=2", "optim.micro_batch_size=3", "loss.beta=0"), str(tmp_path))
    lines = read_metrics(tmp_path)
    assert "train/kl" not in lines[1]  # beta 0: no reference model
    assert lines[2]["train/ratio_dev"] > 0  # later passes see a ratio away from 1


def test_resume_continues_from_the_last_checkpoint(fast_cfg, tmp_path):
    run(fast_cfg("steps=2"), str(tmp_path))
    summary = run(fast_cfg("steps=4"), str(tmp_path))
    lines = read_metrics(tmp_path)
    assert [l["step"] for l in lines] == [0, 1, 2, 3, 4]
    assert summary["steps"] == 4
    assert 0 <= lines[0]["eval/worked"] <= 1 and 0 <= lines[1]["train/worked_d2"] <= 1  # the format the policy chose


def test_resume_with_a_different_config_is_refused_naming_the_keys(fast_cfg, tmp_path):
    import pytest

    run(fast_cfg("steps=2"), str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"written with different loss.beta \(0.04 -> 0.1\), model.hidden_size \(64 -> 32\)"
    ):
        run(fast_cfg("steps=4", "model.hidden_size=32", "loss.beta=0.1"), str(tmp_path))
    moved = fast_cfg("steps=3")
    moved.warm_start.cache_dir = str(tmp_path / "elsewhere")  # the cache may move
    assert run(moved, str(tmp_path))["steps"] == 3


def test_entropy_bonus_changes_the_update(fast_cfg, tmp_path):
    for name, coef in (("plain", 0.0), ("bonus", 0.5)):
        run(fast_cfg("steps=1", "loss.beta=0", f"loss.entropy_coef={coef}"), str(tmp_path / name))
    plain, bonus = (read_metrics(tmp_path / n)[1] for n in ("plain", "bonus"))
    assert plain["train/reward"] == bonus["train/reward"]  # same rollout
    assert plain["train/grad_norm"] != bonus["train/grad_norm"]


def test_pretrained_model_loads_from_a_path(fast_cfg, tmp_path):
    """model=pretrained goes through from_pretrained on a directory the test writes."""
    from rlkit.models import TinyQwen2
    from rlkit.tasks.arithmetic import ALPHABET

    model, tok = TinyQwen2(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64).build(
        ALPHABET, 0
    )
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    cfg = fast_cfg("model=pretrained", f"model.path={tmp_path / 'hf'}", "warm_start.steps=0", "steps=1")
    summary = run(cfg, str(tmp_path / "run"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step_000001" / "policy")
    assert summary["steps"] == 1 and reloaded.config.hidden_size == 32


def test_the_shuffled_reward_control_permutes_the_steps_rewards(fast_cfg, tmp_path):
    """Same seed, same completions at step 1: the shuffled run's rewards are the same values (same
    mean) given to other completions, so its advantages differ."""
    logs = {}
    for shuffle in ("none", "true", "group"):  # true: the older spelling of step
        d = tmp_path / shuffle
        # 8 groups, 16 completions in the sample table: 4 to 11 of them got another's reward at seeds 0-5
        run(fast_cfg("steps=1", f"reward.shuffle={shuffle}", "samples_every=1", "rollout.prompts_per_step=8"), str(d))
        logs[shuffle] = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()][1]
        logs[shuffle, "samples"] = json.loads((d / "samples.jsonl").read_text().splitlines()[0])["samples"]

    def mismatched(samples):  # completions whose reward is not their own answer's score
        return sum(s["reward"] != float(s["completion"].split(";")[-1] == str(eval(s["prompt"][:-1]))) for s in samples)

    plain = logs["none"]
    assert mismatched(logs["none", "samples"]) == 0
    for shuffle in ("true", "group"):
        assert plain["train/gen_tokens"] == logs[shuffle]["train/gen_tokens"]  # the same completions
        assert plain["train/reward_all"] == pytest.approx(logs[shuffle]["train/reward_all"])
        assert plain["train/reward_std"] == pytest.approx(logs[shuffle]["train/reward_std"])
        assert [s["completion"] for s in logs["none", "samples"]] == [s["completion"] for s in logs[shuffle, "samples"]]
        assert mismatched(logs[shuffle, "samples"]) > 0
    # within groups: every group keeps its own rewards, so the groups without spread are the same ones
    assert plain["train/frac_zero_std_groups"] == logs["group"]["train/frac_zero_std_groups"]


@given(st.integers(1, 6), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_a_within_group_permutation_keeps_each_groups_rewards(groups, size, seed):
    torch.manual_seed(seed)
    rewards = torch.rand(groups * size).round(decimals=1)  # [N], ties likely
    out = shuffled(rewards, size, "group")  # [N]
    assert torch.equal(out.view(groups, size).sort(-1).values, rewards.view(groups, size).sort(-1).values)
    assert torch.equal(shuffled(rewards, size, "step").sort().values, rewards.sort().values)
    assert torch.equal(shuffled(rewards, size, "none"), rewards)


def test_adam_epsilon_reaches_the_optimizer(fast_cfg, tmp_path):
    from rlkit.setup import setup

    state = setup(fast_cfg("optim.eps=0.5"), str(tmp_path), {})
    assert [g["eps"] for g in state.parts.optimizer.param_groups] == [0.5]


def test_micro_batches_need_not_divide_the_batch(tmp_path, warm_cache):
    whole = run(make_cfg(["steps=1"], cache_dir=warm_cache), str(tmp_path / "a"))
    split = run(make_cfg(["steps=1", "optim.micro_batch_size=5"], cache_dir=warm_cache), str(tmp_path / "b"))
    a, b = metrics(tmp_path / "a")[1], metrics(tmp_path / "b")[1]
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)
    assert whole["accuracy_after"] == split["accuracy_after"]


def test_eval_seed_per_run_gives_each_run_seed_its_own_evaluation_samples(tmp_path, warm_cache):
    """The warm start is shared by the RL seeds, so the step-0 policy is the same model at seeds 0 and
    1: one eval.seed draws it the same samples (a start measured once), eval.seed_per_run its own."""

    def start(seed: int, per_run: bool) -> float:
        folder = tmp_path / f"s{seed}_{per_run}"
        overrides = ["steps=1", f"seed={seed}", "eval.samples=4", f"eval.seed_per_run={per_run}"]
        run(make_cfg(overrides, cache_dir=warm_cache), str(folder))
        return json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])["eval/mean@4"]

    assert start(0, False) == start(1, False)
    assert start(0, True) != start(1, True)


def test_output_to_a_file_is_plain_lines_and_train_log_holds_them(tmp_path, warm_cache):
    """stderr is a pipe here, as under nohup or SLURM: no bar redraws (carriage returns), a line every
    few steps and one at each evaluation, and the same lines, time-stamped, in train.log."""
    done = train(tmp_path / "run", warm_cache, "steps=4", "eval.every=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr
    lines = [l for l in done.stderr.splitlines() if l.startswith("rlkit: step ")]
    assert [l.split(":")[1].strip() for l in lines] == ["step 0/4", "step 1/4", "step 2/4", "step 3/4", "step 4/4"]
    assert "reward" in lines[1] and "s a step, about" in lines[1]  # every step of 4 (about 20 lines a run)
    assert re.fullmatch(r"rlkit: step 2/4: held-out accuracy \d\.\d{3}", lines[2])  # an evaluation
    logged = (tmp_path / "run" / "train.log").read_text().splitlines()
    ours = [l.split("] ", 1)[1] for l in logged if "] rlkit: " in l]
    assert ours[:5] == lines and ours[-1].startswith("rlkit: held-out accuracy ")


def test_a_runs_wall_time_is_accounted_for_by_what_it_went_to(tmp_path, warm_cache):
    """summary.json splits the session's wall seconds into building, steps, evaluations (each also
    logged as time/eval at its step), checkpoints and the rest, which sum to the session's total."""
    run(make_cfg(["steps=3", "eval.every=2"], cache_dir=warm_cache), str(tmp_path))
    spent = json.loads((tmp_path / "summary.json").read_text())["session_s"]
    assert set(spent) == {"build", "steps", "eval", "checkpoint", "other", "total"}
    parts = sum(v for k, v in spent.items() if k != "total")
    assert parts == pytest.approx(spent["total"], abs=0.05) and min(spent.values()) >= 0
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "time/eval" in l] == [0, 2, 3]  # the evaluations: start, every 2, last
