"""Past the testbed: a saved Hugging Face model with a chat template, with and without LoRA; the
math task scored by math-verify from JSON lines and Parquet files; weighted reward functions."""

import json

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from conftest import make_cfg, save_tiny_qwen2
from rlkit.models import AdaptersOff
from rlkit.refusals import ConfigError
from rlkit.rewards import combine, group_zscore
from rlkit.session import run
from rlkit.setup import setup
from rlkit.tasks.math import Math, last_boxed, reference_answer

CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)
ALPHABET = "0123456789+=;<>abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Qwen2 with a chat template, saved as a user's checkpoint would be."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("hf"), ALPHABET, max_positions=256, chat_template=CHAT)


def pretrained(path, *extra):
    return make_cfg(
        ["model=pretrained", f"model.path={path}", "warm_start.steps=0", "steps=2", "loss.beta=0.04", *extra]
    )


def test_a_saved_model_trains_through_its_chat_template(saved_model, tmp_path):
    state = setup(pretrained(saved_model), str(tmp_path / "s"), {})
    assert state.parts.task.train[0]["prompt"].startswith("<user>") and state.parts.task.train[0]["prompt"].endswith(
        ">"
    )
    assert state.parts.task.train[0]["prompt"] == f"<user>{state.parts.task.train[0]['task_prompt']}>"  # own kept
    # the probe entropy's demonstrations read the task's own prompt under the template
    assert state.progress.first_eval["eval/probe_entropy"] > 0
    assert run(pretrained(saved_model, "model.chat_template=false"), str(tmp_path / "plain"))["steps"] == 2


def test_lora_trains_adapters_only_and_its_reference_is_the_same_model(saved_model, tmp_path):
    cfg = pretrained(saved_model, "model.lora_r=4", "model.lora_targets=[q_proj,v_proj]", "loss.entropy_coef=0.1")
    state = setup(cfg, str(tmp_path / "s"), {})
    assert (
        isinstance(state.parts.ref, AdaptersOff) and state.parts.ref.policy[0] is state.parts.policy
    )  # no second copy
    assert sum(p.numel() for p in state.parts.ref.parameters()) == 0
    run(cfg, str(tmp_path / "run"))
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_000002" / "policy" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    base = load_file(saved_model / "model.safetensors")
    state = setup(cfg, str(tmp_path / "run2"), {})
    state.parts.model.load(state.parts.policy, tmp_path / "run" / "checkpoints" / "step_000002" / "policy")
    merged = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in state.parts.policy.state_dict().items()
        if "lora_" not in k
    }
    assert all(torch.equal(merged[k], v) for k, v in base.items() if k in merged)  # base weights untouched
    lora_b = [v for k, v in state.parts.policy.state_dict().items() if "lora_B" in k]
    assert any(
        v.abs().sum() > 0 for v in lora_b
    )  # the adapters trained (lora_B starts at zero; the entropy bonus moves it)


def test_a_model_that_cannot_be_loaded_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path='.*nowhere' cannot be loaded"):
        run(pretrained(tmp_path / "nowhere"), str(tmp_path / "run"))


def test_reference_answers_and_math_verify_by_hand(tmp_path):
    assert reference_answer("3 + 15 = 18 apples.\n#### 1,018", "gsm8k") == "1018"
    assert last_boxed(r"so \boxed{\frac{1}{2}} and") == r"\frac{1}{2}" and last_boxed("no box") is None
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "half?", "answer": "so\n#### 0.5"}) + "\n")
    task = Math(str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl"))
    row = task.train[0]
    for answer, ok in (
        (r"\boxed{\frac{1}{2}}", 1.0),
        ("1/2", 1.0),
        ("it is 0.5", 1.0),
        (r"\boxed{0.50}", 1.0),
        ("3", 0.0),
        ("", 0.0),
        (r"\boxed{", 0.0),
        ("0.55", 0.0),
    ):
        assert task.reward(row, answer) == ok, answer
    assert task.step_metrics() == {"task/verify_timeouts": 0}


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_math_task_trains_two_steps_from_local_files(tmp_path, fmt):
    rows = [{"question": f"{a}+{b}", "answer": f"{a}+{b}={a + b}\n#### {a + b}"} for a in range(6) for b in range(6)]
    path = tmp_path / f"train.{fmt}"
    Dataset.from_list(rows).to_json(path) if fmt == "json" else Dataset.from_list(rows).to_parquet(path)
    cfg = make_cfg(
        [
            "task=math",
            f"task.train={path}",
            f"task.eval={path}",
            f"task.format={fmt}",
            "task.prompt_template='{question}='",
            "warm_start.steps=0",
        ]
    )
    summary = run(cfg, str(tmp_path / "run"))
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and lines[1]["task/verify_timeouts"] == 0


def test_reward_terms_combine_by_sum_or_group_normalised_sum():
    # two groups of 2; accuracy (1, 0, 1, 1) and format (1, 1, 0, 1), weights 1 and 0.5
    parts = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    assert combine(parts, [1.0, 0.5], 2, "sum").tolist() == [1.5, 0.5, 1.0, 1.5]
    # per group z-scores (sample std): accuracy (0.7071, -0.7071, 0, 0), format (0, 0, -0.7071, 0.7071)
    z = 2**-0.5
    assert torch.allclose(combine(parts, [1.0, 0.5], 2, "normalise"), torch.tensor([z, -z, -z / 2, z / 2]))
    assert group_zscore(torch.tensor([3.0, 3.0]), 2).tolist() == [0.0, 0.0]


def test_each_reward_function_is_logged(tmp_path, warm_cache):
    run(make_cfg(["rewards=accuracy_format", "steps=1"], cache_dir=warm_cache), str(tmp_path))
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 <= line["reward/accuracy"] <= 1 and line["reward/format"] == 0.0  # the testbed never writes \boxed{}
    assert line["train/reward"] == pytest.approx(line["reward/accuracy"])
