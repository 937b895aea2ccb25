"""Models as rewards: a sequence-classification reward model and a generative judge, real
transformers classes the test builds and saves; a batch scores what each text alone would; a
training run with a judge term logs it and its time. (SmolLM2 as the judge: test_smollm2.)"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForSequenceClassification

from conftest import make_cfg
from rlkit.models import char_tokenizer
from rlkit.refusals import ConfigError
from rlkit.reward_models import Judge, RewardModel
from rlkit.session import run

ROWS = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "10+7=", "answer": "17"}, {"prompt": "1+1=", "answer": "2"}]
COMPLETIONS = ["5", "The sum is 17, I think", "3"]
ALPHABET = "0123456789+=?., ISTheanswrkiQPpodYNcCRlyt:\n"


def config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-logit reward model and a causal LM, random weights, each with a character tokenizer."""
    root, tokenizer = tmp_path_factory.mktemp("models"), char_tokenizer(ALPHABET)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config(num_labels=1, pad_token_id=tokenizer.pad_token_id))
    lm = AutoModelForCausalLM.from_config(config())
    for name, model in (("rm", rm), ("lm", lm)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def alone(model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def test_a_reward_model_scores_a_batch_as_each_text_alone(saved):
    rm = RewardModel(path=str(saved / "rm"), batch_size=2)
    got = rm.batch(ROWS, COMPLETIONS)
    want = [float(alone(rm.model, rm.tokenizer, text)[0]) for text in rm.texts(ROWS, COMPLETIONS)]
    assert got == pytest.approx(want, abs=1e-5)
    assert rm.texts(ROWS, COMPLETIONS)[0] == "2+3=\n5"  # no chat template: prompt and reply on two lines
    assert len(set(got)) == 3 and rm(ROWS[0], COMPLETIONS[0], task=None) == pytest.approx(got[0], abs=1e-5)


def test_a_judge_scores_p_yes_against_p_no_of_its_next_token(saved):
    judge = Judge("Q {prompt} A {completion} ok?", path=str(saved / "lm"), accept="Y", reject="N", batch_size=2)
    got = judge.batch(ROWS, COMPLETIONS)
    yes, no = judge.tokens
    for text, score in zip(judge.texts(ROWS, COMPLETIONS), got):
        last = alone(judge.model, judge.tokenizer, text)[-1]
        assert score == pytest.approx(float(torch.softmax(last[[yes, no]], -1)[0]), abs=1e-5)
    assert judge.texts(ROWS, COMPLETIONS)[1] == "Q 10+7= A The sum is 17, I think ok?"
    alone_yes = Judge("Q {prompt} A {completion} ok?", path=str(saved / "lm"), accept="Y", reject=None)
    for text, score in zip(alone_yes.texts(ROWS, COMPLETIONS), alone_yes.batch(ROWS, COMPLETIONS)):
        last = alone(alone_yes.model, alone_yes.tokenizer, text)[-1]
        assert score == pytest.approx(float(torch.softmax(last, -1)[yes]), abs=1e-6)  # over the vocabulary


def test_a_judge_needs_one_model_and_answers_of_different_first_tokens(saved):
    with pytest.raises(ConfigError, match="exactly one of `path` and `model`"):
        Judge("{prompt}")
    with pytest.raises(ConfigError, match="start with one token"):
        Judge("{prompt}", path=str(saved / "lm"), accept="Y", reject="Yes")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        RewardModel(path=str(saved / "nowhere"))


def test_a_run_with_a_judge_term_logs_it_and_its_time(saved, tmp_path, warm_cache):
    judge = ["rewards=judge", "reward.functions.judge.model=null", f"reward.functions.judge.path={saved / 'lm'}",
             "reward.functions.judge.accept=Y", "reward.functions.judge.reject=N"]  # fmt: skip
    run(make_cfg(["steps=2", "eval.every=0", *judge], warm_cache), str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(0 < r["reward/judge"] < 1 and r["time/reward_judge"] > 0 for r in rows)
    assert all(r["time/reward_judge"] <= r["time/score"] for r in rows)
