"""The calculator tool: exact answers, and an error string (never an exception or a hang) for hostile input."""

import re
import time
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.environments import Calculator, ToolEpisode, last_tool_call, tool_metrics, turn_rewards
from rlkit.refusals import ConfigError
from rlkit.tools.calculator import MAX_CHARS, calculate


def test_hand_worked_expressions():
    assert calculate("12*34") == "408"
    assert calculate(" (1 + 2) * 3 ") == "9"
    assert calculate("7/2") == "3.5"
    assert calculate("1/3") == "0.333333"
    assert calculate("2--2") == "4"
    assert calculate("-(4-10)/3") == "2"
    assert calculate("0.1+0.2") == "0.3"  # exact rationals, not binary floats


def test_hostile_input_gets_an_error_string():
    hostile = [
        "",
        "1+",
        "abc",
        '__import__("os").system("ls")',
        "1/0",
        "(" * 40 + "1" + ")" * 40,
        "-" * 100 + "1",
        "9" * 30,
        "999999999*999999999*999999999",
        "1" + "*10" * 60,
        "2" * 250,
        "1 2",
        ")(",
        None,
    ]
    for text in hostile:
        start = time.perf_counter()
        answer = calculate(text)
        assert answer.startswith("error: "), (text, answer)
        assert time.perf_counter() - start < 1.0  # microseconds in fact; a second only catches a hang


integers = st.integers(min_value=0, max_value=999)


@st.composite
def expressions(draw, depth=0):
    """Integer expressions over + - * and parentheses, as text."""
    if depth >= 3 or draw(st.booleans()):
        return str(draw(integers))
    op = draw(st.sampled_from("+-*"))
    return f"({draw(expressions(depth + 1))}{op}{draw(expressions(depth + 1))})"


@settings(max_examples=200, deadline=None)
@given(expressions())
def test_integer_expressions_match_python_arithmetic(text):
    assert calculate(text) == str(eval(text))  # the reference only; the tool itself never evaluates text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/(). x", max_size=MAX_CHARS))
def test_any_text_gets_a_number_or_an_error(text):
    answer = calculate(text)
    if not answer.startswith("error: "):
        Fraction(answer)  # a number


def call(body: str) -> str:
    return f"Let me compute. <tool_call>{body}</tool_call>"


def test_an_episode_answers_a_tool_call_and_ends_at_a_turn_without_one():
    ep = Calculator().start({"prompt": "What is 12 + 34?"})
    assert ep.reply(call('{"name": "calculator", "arguments": {"expression": "12 + 34"}}')) == {
        "role": "tool",
        "content": "46",
    }
    assert ep.reply("The answer is 46.") is None
    assert (ep.turns, ep.calls, ep.errors) == (2, 1, 0)


def test_hostile_tool_calls_get_an_error_string_never_an_exception_or_a_hang():
    hostile = [
        "not json",
        "[" * 100_000,  # nesting past the JSON parser's recursion limit
        '{"name": "calculator", "arguments": {"expression": "' + "9" * 1_000_000 + '"}}',
        '{"name": "calculator", "arguments": {"expression": "' + "(" * 5000 + '1"}}',
        '{"name": "calculator", "arguments": {"expression": "999999999999**99"}}',
        '{"name": "calculator", "arguments": {"expression": 12}}',
        '{"name": "calculator", "arguments": "12 + 34"}',
        '{"name": "calculator"}',
        '{"name": "shell", "arguments": {"command": "rm -rf /"}}',
        '{"name": "calculator", "arguments": {"expression": "__import__(\'os\').system(\'ls\')"}}',
        "[1, 2]",
        "null",
    ]
    ep = Calculator().start({})
    for body in hostile:
        start = time.perf_counter()
        message = ep.reply(call(body))
        assert message["role"] == "tool" and message["content"].startswith("error: "), (body[:40], message)
        assert time.perf_counter() - start < 1.0
    assert ep.calls == ep.errors == len(hostile)


def test_each_failed_call_adds_the_error_reward_to_the_episodes_reward():
    ep = Calculator(error_reward=-0.25).start({})
    good = '{"name": "calculator", "arguments": {"expression": "2 + 2"}}'
    for body in ["not json", good, '{"name": "shell"}']:
        ep.reply(call(body))
    assert ep.reply("The answer is 4.") is None
    assert (ep.calls, ep.errors, ep.reward) == (3, 2, -0.5)
    plain = Calculator().start({})
    plain.reply(call("not json"))
    assert (plain.errors, plain.reward) == (1, 0.0)
    assert turn_rewards([ep, plain]).tolist() == [-0.5, 0.0]
    assert turn_rewards([plain, object()]) is None  # all 0 (an episode without `reward` counts 0): no term


def test_the_calculator_refuses_a_turn_budget_without_room_and_malformed_preambles():
    with pytest.raises(ConfigError, match="max_turns"):
        Calculator(max_turns=1)
    with pytest.raises(ConfigError, match="max_turns"):
        Calculator(max_turns=float("inf"))
    with pytest.raises(ConfigError, match=r"messages \[1\]"):
        Calculator(preamble=[{"role": "system", "content": "hi"}, {"role": "user"}])
    assert Calculator(preamble=[{"role": "system", "content": "hi"}]).preamble == ({"role": "system", "content": "hi"},)
    for bad in [float("nan"), "-0.1", None]:
        with pytest.raises(ConfigError, match="error_reward must be a finite number"):
            Calculator(error_reward=bad)


def test_tool_metrics_by_hand():
    played = [Calculator().start({}) for _ in range(4)]
    for ep, text in zip(
        played, [call('{"name": "calculator", "arguments": {"expression": "1+1"}}'), "2", call("x"), "3"]
    ):
        ep.reply(text)
    played[0].reply("The answer is 2.")
    m = tool_metrics(played, torch.tensor([True, True, False, False]))
    assert m == {
        "turns": 5 / 4,
        "tool_calls": 2 / 4,
        "tool_errors": 1 / 4,
        "tool_use": 2 / 4,
        "accuracy_tool": 1 / 2,  # episodes 0 (right) and 2 (wrong) called it
        "accuracy_no_tool": 1 / 2,
    }


TAG_PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "a", '{"x": 1}', " ", "\n"])


@settings(max_examples=500, deadline=None)
@given(st.lists(TAG_PIECES, max_size=16).map("".join))
def test_the_last_tool_call_is_the_last_non_greedy_match(text):
    """The one-pass scan pairs tags as the regex `<tool_call>(.*?)</tool_call>` (DOTALL) did."""
    found = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    assert last_tool_call(text) == (found[-1] if found else None)


class Scans(str):
    """A text that counts the scans (`find` calls) made over it."""

    calls = 0

    def find(self, *args):
        Scans.calls += 1
        return super().find(*args)


def test_many_unclosed_tool_call_tags_are_read_in_one_pass():
    """30,000 opening tags and no closing one: the regex scan restarted at each opening tag (time
    quadratic in their number); the one-pass scan looks for the opening tag and the closing one
    once each, and finds no call."""
    Scans.calls = 0
    assert last_tool_call(Scans("<tool_call>" * 30_000)) is None and Scans.calls == 2
    episode = ToolEpisode("tool")
    assert episode.reply("<tool_call>" * 30_000) is None and episode.calls == 0
    closed = "<tool_call>" * 30_000 + '{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    # one call, from the first opening tag to the closing one, as the regex paired them: not JSON
    assert ToolEpisode("tool").reply(closed)["content"].startswith("error: the tool call is not JSON")
    assert ToolEpisode("tool").reply("<tool_call>" + closed.removeprefix("<tool_call>" * 30_000))["content"] == "5"


def test_a_calculator_whose_episodes_never_call_the_tool_says_so_once(capsys):
    """A model that never writes a call trains as on a single-turn task, silently; after the
    first evaluation and four steps without one call the environment warns, once."""
    env = Calculator()
    idle = [ToolEpisode("tool") for _ in range(4)]
    for episode in idle:
        episode.reply("The answer is 5.")
    for _ in range(Calculator.IDLE_WARNING + 3):
        env.metrics(idle, torch.zeros(4, dtype=torch.bool))
    assert capsys.readouterr().err.count("no episode called the tool in its first 5 batches") == 1
    used = Calculator()
    called = ToolEpisode("tool")
    called.reply('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    for _ in range(Calculator.IDLE_WARNING + 3):
        used.metrics([called], torch.ones(1, dtype=torch.bool))
    assert "no episode called the tool" not in capsys.readouterr().err
