"""verifiers environments run by rlkit (`task=verifiers environment=verifiers`), checked against the
same episodes driven by verifiers' own rollout code. The environment is the repository's example,
experiments/verifiers/vf_multiply.py (a `multiply` tool and a rubric); verifiers' side gets its model
turns from a scripted client (a `verifiers.Client` that returns hand-built responses), the test
double for the model server verifiers otherwise calls: rlkit's side needs none."""

import asyncio
import json
import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("verifiers")
from verifiers import Client  # noqa: E402
from verifiers.errors import OverlongPromptError  # noqa: E402
from verifiers.types import Response, ResponseMessage, ToolCall  # noqa: E402

from conftest import make_cfg, save_tiny_qwen2  # noqa: E402
from rlkit.engines.kv_cache import generate  # noqa: E402
from rlkit.engines.turns import reply_ids  # noqa: E402
from rlkit.environments import Checked, episodes, verdicts  # noqa: E402
from rlkit.refusals import ConfigError  # noqa: E402
from rlkit.session import run  # noqa: E402
from rlkit.verifiers_env import Verifiers, VerifiersTask, response  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARGS = {"n_train": 8, "n_eval": 4}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments" / "verifiers"))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2 whose character tokenizer writes any ASCII text, with a ChatML template."""
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    return save_tiny_qwen2(tmp_path_factory.mktemp("hf"), alphabet, max_positions=2048, chat_template=CHATML)


class Scripted(Client):
    """verifiers' side: a client that answers each model call with the next hand-built response, then
    (past the script) fails as an overlong prompt does, as rlkit's budget ends an episode."""

    def __init__(self, responses: list):
        super().__init__(None)
        self.responses = list(responses)

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        if not self.responses:
            raise OverlongPromptError("the script ended")
        return self.responses.pop(0)

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        return response

    async def close(self):
        return None


def said(turn: int, content: str, calls=(), truncated: bool = False) -> Response:
    """A model turn as a model server's hermes parser returns it, built by hand."""
    tool_calls = [ToolCall(id=f"call_{turn}_{i}", name=n, arguments=json.dumps(a)) for i, (n, a) in enumerate(calls)]
    finish = "length" if truncated else "tool_calls" if calls else "stop"
    message = ResponseMessage(
        content=content, tool_calls=tool_calls or None, finish_reason=finish, is_truncated=truncated
    )
    return Response(id=f"rlkit-{turn}", created=0, model="rlkit", message=message)


def own_rollout(env: Verifiers, row: dict, responses: list) -> dict:
    """The episode driven by verifiers' own code: `Environment.run_rollout` with the scripted client."""
    return asyncio.run(env.vf.run_rollout(json.loads(row["vf_input"]), Scripted(responses), "rlkit", {}))


def comparable(output: dict) -> dict:
    """What a rollout produced: the messages (without timings), reward, metrics, and how it stopped."""
    messages = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in output["completion"]]
    for m in messages:
        calls = m.get("tool_calls") or []
        m["tool_calls"] = [json.loads(c) if isinstance(c, str) else dict(c) for c in calls] or None
    keys = ("reward", "metrics", "is_truncated", "stop_condition")
    return {"messages": json.dumps(messages, sort_keys=True), **{k: output[k] for k in keys}}


def product(row: dict) -> tuple[int, int, int]:
    a, b = (int(x.strip("?")) for x in row["prompt"].split()[2::2])
    return a, b, a * b


def test_tool_calls_are_read_as_a_hermes_parser_reads_them():
    r = response('Let me see. <tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>', 1, False)
    assert r.message.content == "Let me see."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in r.message.tool_calls] == [
        ("call_1_0", "multiply", {"a": 2, "b": 3})
    ]
    assert r.message.finish_reason == "tool_calls"
    two = response(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>', 2, False
    )
    assert [c.name for c in two.message.tool_calls] == ["f", "g"] and two.message.content == ""
    for text in ("<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "42", "<tool_call>{"):
        r = response(text, 1, True)
        assert r.message.tool_calls is None and r.message.content == text and r.message.finish_reason == "length"


def test_a_scripted_episode_gives_what_verifiers_own_rollout_gives():
    """A tool call, its result, the answer: the same messages, reward and metrics as verifiers'
    `run_rollout` on the same model turns; likewise a wrong answer, an answer without a call, a call
    to a tool that does not exist, and a turn whose call is not JSON (which ends the episode)."""
    task, env = VerifiersTask("vf_multiply", ARGS), Checked(Verifiers("vf_multiply", ARGS))
    row = task.train[0]
    a, b, ab = product(row)
    call = ("multiply", {"a": a, "b": b})
    scripts = [
        (
            [
                f"Using the tool. <tool_call>{json.dumps({'name': call[0], 'arguments': call[1]})}</tool_call>",
                f"It is {ab}.",
            ],
            [said(1, "Using the tool.", [call]), said(2, f"It is {ab}.")],
            1.0,
        ),
        ([f"It is {ab + 1}."], [said(1, f"It is {ab + 1}.")], 0.0),
        (
            ['<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>', f"{ab}"],
            [said(1, "", [("divide", {"a": 1})]), said(2, f"{ab}")],
            1.0,
        ),
        (["<tool_call>{oops}</tool_call>"], [said(1, "<tool_call>{oops}</tool_call>")], 0.0),
    ]
    for texts, responses, reward in scripts:
        ep = env.start(row)
        replies = [ep.reply(t) for t in texts]
        assert replies[-1] is None and all(isinstance(r, list) for r in replies[:-1])
        ours, theirs = comparable(ep.finish()), comparable(own_rollout(env.inner, row, responses))
        assert ours == theirs and ours["reward"] == reward and ep.reward == reward
    assert replies == [None]  # the last script: no call read, so the episode is over after one turn


def test_a_tool_result_comes_back_as_the_tool_message_verifiers_appends():
    env, row = Verifiers("vf_multiply", ARGS), VerifiersTask("vf_multiply", ARGS).train[1]
    a, b, ab = product(row)
    ep = env.start(row)
    assert ep.reply(f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>') == [
        {"role": "tool", "content": str(ab)}
    ]
    assert ep.reply("Done.") is None and ep.reward == 0.0 and not ep.correct  # no number: the rubric pays 0


def test_a_budget_cut_ends_the_rollout_as_an_overlong_prompt_with_the_unfinished_turn():
    env, row = Verifiers("vf_multiply", ARGS), VerifiersTask("vf_multiply", ARGS).train[2]
    a, b, ab = product(row)
    ep = env.start(row)
    ep.reply(f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>')
    ep.cut(f"So {ab}")  # the token budget ended the answer here
    ours = comparable(ep.finish())
    call = ("multiply", {"a": a, "b": b})
    theirs = comparable(own_rollout(env, row, [said(1, "", [call]), said(2, f"So {ab}", truncated=True)]))
    assert ours == theirs and ours["is_truncated"] and ours["reward"] == 1.0
    ep = env.start(row)
    ep.reply(f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>')
    ep.cut("")  # cut after the tool's reply, before a word of the answer
    assert comparable(ep.finish()) == comparable(own_rollout(env, row, [said(1, "", [call])]))
    assert ep.output["stop_condition"] == "prompt_too_long" and ep.reward == 0.0


def test_several_messages_after_a_turn_are_what_the_chat_template_writes(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    msgs = [{"role": "tool", "content": "6"}, {"role": "tool", "content": "7"}]
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "x"}, *msgs]
    whole = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    after = whole[whole.index("x") + 1 :]
    assert reply_ids(tok, msgs, after_eos=False) == tok(after, add_special_tokens=False)["input_ids"]
    assert "tool" in after and after.endswith("assistant\n")


def test_episodes_through_the_engine_replay_identically_in_verifiers_own_code(chat_model):
    """The tiny model's episodes, decoded by rlkit's engine with a budget that cuts some of them:
    each one's turns, handed to verifiers' own rollout as a server would return them, give the same
    messages, reward and stop; the verdicts are the rubric's."""
    from rlkit.models import Pretrained

    model, tok = Pretrained(str(chat_model)).build("", 0)
    task, env = VerifiersTask("vf_multiply", ARGS), Checked(Verifiers("vf_multiply", ARGS))
    rows = [task.train[i] for i in range(4)] * 2
    chat = [*env.preamble, {"role": "user", "content": ""}]
    prompts = [
        tok.apply_chat_template(
            chat[:-1] + [{**chat[-1], "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    torch.manual_seed(0)
    ep = episodes(env, rows)
    gen = generate(model.eval(), tok, prompts, 24, 1.0, episodes=ep)
    assert bool(gen.truncated.any())  # the budget cut some episodes
    for row, e in zip(rows, ep.each):
        e, last = e.inner, len(e.texts) - 1
        responses = [response(t, i + 1, truncated=e.unfinished and i == last) for i, t in enumerate(e.texts)]
        assert comparable(e.finish()) == comparable(own_rollout(env.inner, row, responses))
    assert verdicts(ep).tolist() == [e.reward >= 0.5 for e in ep.each]


def load_environment(n: int = 8):
    """A single-turn verifiers environment (this module, `task.env=test_verifiers`) whose rubric pays
    the share of digits in the answer, so that a random model's answers earn different rewards."""
    import verifiers as vf
    from datasets import Dataset

    parser = vf.Parser()

    def digits(completion, **kwargs) -> float:
        text = parser.parse_answer(completion) or ""
        return sum(c.isdigit() for c in text) / max(len(text), 1)

    data = Dataset.from_list([{"question": f"Write {i} digits.", "answer": str(i)} for i in range(n)])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[digits], parser=parser), parser=parser)


def test_a_run_trains_on_the_rubrics_score(chat_model, tmp_path):
    """The example environment runs under rlkit's loop (its metrics logged); an environment whose
    rubric pays random answers differently trains: each step's reward is the rubric's mean score,
    its spread is not 0, and the weights move."""
    base = ["model=pretrained", f"model.path={chat_model}", "environment=verifiers", "warm_start.steps=0"]
    example = ROOT / "experiments" / "verifiers" / "vf_multiply.py"  # by its file's path
    tool = [*base, "task=verifiers", f"task.env={example}", "task.env_args={n_train: 8, n_eval: 4}"]
    assert run(make_cfg([*tool, "rollout.max_new_tokens=32", "eval.every=2"]), str(tmp_path / "tool"))["steps"] == 2
    last = json.loads((tmp_path / "tool" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"eval/vf_product", "eval/vf_multiply_calls", "eval/vf_truncated", "env/vf_num_turns"} <= set(last)
    digits = [*base, "task=verifiers", "task.env=test_verifiers", "rollout.max_new_tokens=16", "checkpoint.every=1"]
    assert run(make_cfg(digits), str(tmp_path / "digits"))["steps"] == 2
    steps = [json.loads(x) for x in (tmp_path / "digits" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "train/reward" in x]
    assert len(steps) == 2
    for x in steps:
        assert x["train/reward"] == pytest.approx(x["env/vf_digits"], abs=1e-6) and x["train/reward_std"] > 0
    weights = [load_file(p) for p in sorted((tmp_path / "digits" / "checkpoints").glob("*/policy/model.safetensors"))]
    assert len(weights) == 2 and any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_task_and_the_environment_refuse_to_run_apart(chat_model, tmp_path):
    base = ["model=pretrained", f"model.path={chat_model}", "warm_start.steps=0"]
    with pytest.raises(ConfigError, match="scored by its episodes"):
        run(make_cfg([*base, "task=verifiers", "task.env=vf_multiply"]), str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="runs the environment of task=verifiers"):
        run(make_cfg([*base, "environment=verifiers"]), str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="could not load"):
        VerifiersTask("no_such_environment_module")
    (tmp_path / "not_an_env.py").write_text("def load_environment():\n    return {'prompt': 'hi'}\n")
    with pytest.raises(ConfigError, match="returned a dict, not an environment of verifiers' classic API"):
        VerifiersTask(str(tmp_path / "not_an_env.py"))


FORGETFUL = """
import verifiers as vf
from datasets import Dataset


class Forgetful(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Again."}]

    async def get_prompt_messages(self, state):
        return (await super().get_prompt_messages(state))[-1:]  # only the last message


def load_environment():
    return Forgetful(dataset=Dataset.from_list([{"question": "Say something.", "answer": "x"}]), max_turns=3)
"""


def test_an_environment_that_rewrites_the_conversation_is_refused_naming_it(tmp_path):
    """rlkit runs an episode as one growing conversation (its KV cache); an environment whose model
    calls see a rewritten history (here: only the last message) is refused, not run on a wrong
    prefix. The environment is a file given by its path."""
    path = tmp_path / "forgetful.py"
    path.write_text(FORGETFUL)
    ep = Checked(Verifiers(str(path))).start(VerifiersTask(str(path)).train[0])
    with pytest.raises(ConfigError, match="environment=verifiers: its rollout rewrote the conversation"):
        ep.reply("Hello.")
