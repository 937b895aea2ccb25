"""Environments (group `environment`): what answers the model between its turns. `single_turn`
ends every episode after the model's first turn (today's one prompt, one completion); `calculator`
answers each JSON tool call with the calculator's result."""

from __future__ import annotations

import inspect
import json
import math
import sys

import torch

from rlkit.components import Environment
from rlkit.refusals import ConfigError, require
from rlkit.tools.calculator import calculate
from rlkit.types import Episodes

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def last_tool_call(text: str) -> str | None:
    """The body of the last complete `<tool_call>...</tool_call>` in `text` (each call from an
    opening tag to the first closing tag after it, as a non-greedy match pairs them), in one pass:
    a regex scan restarted at every unclosed opening tag took time quadratic in their number."""
    body, pos = None, 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break  # no call closes after this opening, nor after any later one
        body, pos = text[start + len(OPEN) : end], end + len(CLOSE)
    return body


def episodes(env: Environment, rows: list[dict]) -> Episodes | None:
    """One episode per row, or None for a single-turn environment (the engine's one-turn path)."""
    if env.max_turns == 1:
        return None
    return Episodes([env.start(r) for r in rows], env.max_turns, tuple(env.stop_strings))


def generate(
    engine,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    ep: Episodes | None,
    draws=None,
    forced=None,
):
    """The engine's generation: the single-turn call every engine takes, with `episodes` for a
    multi-turn one, `draws` (`rlkit.draws.RowDraws`) for keyed uniforms, each passed only when set,
    and `forced` for teacher-forced tokens' entropies to an engine that takes it (`rlkit.components.Engine`)."""
    extra = {k: v for k, v in (("episodes", ep), ("draws", draws)) if v is not None}
    if forced is not None and "forced" in inspect.signature(engine.generate).parameters:
        extra["forced"] = forced  # an optional capability: an engine without it returns no entropies
    return engine.generate(prompts, max_new_tokens, temperature, top_p, **extra)


def verdicts(ep: Episodes | None) -> torch.Tensor | None:
    """Each episode's own verdict on its answer (`correct`, where every episode gives one, e.g. a
    verifiers rubric's), which takes the place of the task's [N]; None where they give none."""
    if ep is None or not all(hasattr(e, "correct") for e in ep.each):
        return None
    return torch.tensor([bool(e.correct) for e in ep.each])


def turn_rewards(each: list) -> torch.Tensor | None:
    """The per-turn reward terms each episode summed (its `reward`, 0 without one) [N]; None when all are 0."""
    terms = torch.tensor([float(getattr(e, "reward", 0.0)) for e in each])  # [N]
    return terms if bool(terms.any()) else None


class Checked(Environment):
    """An environment held to its contract (`rlkit.components.Environment`) where its values enter:
    `max_turns` an integer >= 1 and `stop_strings` strings, checked when it is built; each reply a
    chat message (a dict with a string `role` and `content`) or None, and `metrics` a dict of numbers
    (or None), checked at each call; an exception inside `start`, `reply` or `metrics` reported
    naming the environment. Every failure is a `ConfigError` (exit 2) naming `environment=<class>`."""

    def __init__(self, env):
        self.inner, self.name = env, f"environment={type(env).__module__}.{type(env).__qualname__}"
        turns, stops = env.max_turns, env.stop_strings
        require(
            isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1,
            f"{self.name}: max_turns must be an integer >= 1, got {turns!r}",
        )
        require(
            isinstance(stops, (tuple, list)) and all(isinstance(x, str) and x for x in stops),
            f"{self.name}: stop_strings must be a tuple of non-empty strings, got {stops!r}",
        )
        self.max_turns, self.stop_strings, self.preamble = turns, tuple(stops), env.preamble

    def start(self, row: dict) -> "CheckedEpisode":
        return CheckedEpisode(self.call("start", self.inner.start, row), self)

    def metrics(self, episodes: list, correct: torch.Tensor) -> dict:
        out = self.call("metrics", self.inner.metrics, [e.inner for e in episodes], correct)
        ok = isinstance(out, dict) and all(
            isinstance(k, str) and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))
            for k, v in out.items()
        )
        require(ok, f"{self.name}: metrics must return a dict of names to numbers (or None), got {out!r:.200}")
        return out

    def call(self, what: str, fn, *args):
        """`fn(*args)`, an exception in it reported as the environment's, with its type and message."""
        try:
            return fn(*args)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{self.name}: its {what} raised {type(e).__name__}: {e}") from e


class CheckedEpisode:
    """One episode of a `Checked` environment: its replies checked as chat messages, its other
    attributes the episode's own."""

    def __init__(self, inner, env: Checked):
        self.inner, self.env = inner, env

    def __getattr__(self, name: str):
        """The episode's own attributes (its `reward`, its counters), read through."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reply(self, text: str) -> dict | list | None:
        message = self.env.call("reply", self.inner.reply, text)
        each = message if isinstance(message, list) else [message]
        ok = message is None or all(
            isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content")) for m in each
        )
        require(
            ok,
            f"{self.env.name}: reply must return a chat message (a dict with a string role and content), a list "
            f"of them, or None to end the episode, got {message!r:.200}",
        )
        return message

    def cut(self, text: str) -> None:
        if hasattr(self.inner, "cut"):
            self.env.call("cut", self.inner.cut, text)


class SingleTurn(Environment):
    """One model turn per episode: the prompt, the completion, the task's reward. `preamble`: chat
    messages put before every task prompt (e.g. a system prompt)."""

    def __init__(self, preamble: list = ()):
        self.preamble = chat_messages(preamble)

    def start(self, row: dict):
        return None

    def metrics(self, episodes: list, correct: torch.Tensor) -> dict:
        return {}


class Calculator(Environment):
    """A calculator tool. The model calls it in the chat-template tool format,
    `<tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>`; the
    turn ends at `</tool_call>` and the result (or an `error: ...` string) comes back as a message
    of `role`. A turn without a tool call is the final answer and ends the episode. `max_turns`
    counts the model's turns, the answer included. `preamble`: chat messages put before every task
    prompt (e.g. a system prompt and an example exchange that shows one call). `error_reward`: the
    per-turn reward term of a call that fails (e.g. -0.1), added to the episode's reward; 0: none."""

    stop_strings = ("</tool_call>",)

    def __init__(self, max_turns: int = 3, role: str = "tool", preamble: list = (), error_reward: float = 0.0):
        require(
            isinstance(max_turns, int) and max_turns >= 2,
            f"environment.max_turns must be an integer >= 2 (a tool call, then the answer), got {max_turns}",
        )
        require(
            isinstance(error_reward, (int, float)) and math.isfinite(error_reward),
            f"environment.error_reward must be a finite number, got {error_reward!r}",
        )
        self.max_turns, self.role, self.preamble = max_turns, role, chat_messages(preamble)
        self.error_reward = float(error_reward)
        self.batches, self.used = 0, False  # batches of episodes seen; whether any episode called the tool

    IDLE_WARNING = 5  # batches of episodes (the first evaluation, then steps) without a call before a warning

    def start(self, row: dict) -> "ToolEpisode":
        return ToolEpisode(self.role, self.error_reward)

    def metrics(self, episodes: list, correct: torch.Tensor) -> dict:
        out = tool_metrics(episodes, correct)
        self.batches, self.used = self.batches + 1, self.used or bool(out["tool_use"])
        if not self.used and self.batches == self.IDLE_WARNING:
            print(
                "rlkit: warning: environment=calculator: no episode called the tool in its first "
                f"{self.batches} batches (the first evaluation and the first steps); a model that never writes "
                '<tool_call>{"name": "calculator", ...}</tool_call> trains as on a single-turn task. Check the '
                "model's chat template and environment.preamble (an example call)",
                file=sys.stderr,
            )
        return out


def chat_messages(messages) -> tuple:
    """`environment.preamble` as plain chat messages, each with a string `role` and `content`."""
    out = tuple({k: m.get(k) for k in ("role", "content")} if hasattr(m, "get") else {} for m in messages)
    bad = [i for i, m in enumerate(out) if not all(isinstance(m.get(k), str) for k in ("role", "content"))]
    require(not bad, f"environment.preamble: messages {bad} need a string role and content")
    return out


class ToolEpisode:
    """One calculator episode: the model's turns, its tool calls, the calls that failed and the
    per-turn reward terms they earned."""

    def __init__(self, role: str, error_reward: float = 0.0):
        self.role, self.turns, self.calls, self.errors = role, 0, 0, 0
        self.error_reward, self.reward = error_reward, 0.0

    def reply(self, text: str) -> dict | None:
        self.turns += 1
        call = last_tool_call(text)
        if call is None:
            return None  # the final answer
        self.calls += 1
        result = run_call(call)
        failed = result.startswith("error")
        self.errors += failed
        self.reward += self.error_reward * failed
        return {"role": self.role, "content": result}


def run_call(body: str) -> str:
    """The result of one tool call's JSON body, or an error string saying what was wrong with it."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as e:
        return f"error: the tool call is not JSON ({str(e)[:80]})"
    if not isinstance(call, dict) or call.get("name") != "calculator":
        return 'error: the only tool is "calculator"'
    args = call.get("arguments")
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return 'error: the calculator takes {"expression": "<numbers and + - * / ( )>"}'
    return calculate(expression)


def tool_metrics(episodes: list, correct: torch.Tensor) -> dict:
    """Turns, tool calls and errors per episode, the share of episodes that called the tool, and the
    accuracy of the episodes with and without a call (None where there are none)."""
    turns = torch.tensor([e.turns for e in episodes], dtype=torch.float)  # [N]
    calls = torch.tensor([e.calls for e in episodes], dtype=torch.float)  # [N]
    errors = torch.tensor([e.errors for e in episodes], dtype=torch.float)  # [N]
    used, correct = calls > 0, correct.cpu().float()  # [N] each

    def mean(x: torch.Tensor) -> float | None:
        return float(x.mean()) if x.numel() else None

    return {
        "turns": mean(turns),
        "tool_calls": mean(calls),
        "tool_errors": mean(errors),
        "tool_use": mean(used.float()),
        "accuracy_tool": mean(correct[used]),
        "accuracy_no_tool": mean(correct[~used]),
    }
