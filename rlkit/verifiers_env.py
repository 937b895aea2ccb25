"""Environments written with the `verifiers` package (`pip install "rlkit[verifiers]"`), run by
rlkit's multi-turn engine: `task=verifiers environment=verifiers task.env=<module or .py file>`.

The task's rows are the environment's dataset; each episode is the environment's own rollout (its
`env_response`, stop conditions and tools), run on an event loop in a background thread, whose
model calls rlkit's engine answers: every model turn the engine decodes goes back to the rollout
as the response of a chat client, its tool calls parsed from the Hermes format chat templates write
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as vLLM's `hermes` parser reads it),
and the messages the environment appends come back to the engine, which feeds them through the
model's chat template. After the rollout the rubric scores it, as verifiers itself does; that score
is the episode's reward and `score >= pass_threshold` its verdict (the accuracy metrics). Nothing
needs a server: the client is rlkit's engine."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import queue
import re
import threading
import time
from pathlib import Path

import torch
from datasets import Dataset
from omegaconf import DictConfig, OmegaConf

from rlkit.components import Environment
from rlkit.refusals import ConfigError, require
from rlkit.tasks.base import Task, TaskError

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def vf_environment(env: str, env_args=None):
    """The verifiers environment `env`: an installed module with `load_environment` (as verifiers' own
    `load_environment` finds it) or the path of a .py file with one; loaded once per process, for the
    task and the environment alike."""
    args = OmegaConf.to_container(env_args) if isinstance(env_args, DictConfig) else dict(env_args or {})
    return _load(env, json.dumps(args, sort_keys=True))


@functools.cache
def _load(env: str, args: str):
    try:
        import verifiers as vf
    except ImportError as e:
        raise ConfigError('task=verifiers needs the verifiers package: pip install "rlkit[verifiers]"') from e
    try:
        loaded = (
            from_file(env, json.loads(args)) if env.endswith(".py") else vf.load_environment(env, **json.loads(args))
        )
    except Exception as e:
        raise ConfigError(f"task.env={env!r}: verifiers could not load it: {type(e).__name__}: {e}") from e
    require(
        isinstance(loaded, vf.Environment),
        f"task.env={env!r}: load_environment returned a {type(loaded).__name__}, not an environment of verifiers' "
        "classic API (verifiers.Environment: SingleTurnEnv, MultiTurnEnv, ToolEnv, ...), which rlkit runs",
    )
    require(
        not loaded.requires_group_rollouts,
        f"task.env={env!r}: its rubric scores whole groups together, which rlkit's episodes (one at a time) cannot",
    )
    return loaded


def from_file(path: str, args: dict):
    """The environment that `load_environment(**args)` of the Python file at `path` returns."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    require(spec is not None and Path(path).is_file(), f"task.env={path!r}: no such file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_environment(**args)


def head(vf_env) -> tuple:
    """The chat messages before the last one of the environment's first prompt (its system prompt,
    its few-shot turns), which rlkit puts before every prompt."""
    data = vf_env.get_dataset(1) if vf_env.dataset_source is not None else vf_env.get_eval_dataset(1)
    return tuple(data["prompt"][0][:-1])


def rows(data, split: str, preamble: tuple) -> Dataset:
    """A verifiers dataset as rlkit rows: the prompt's last (user) message, the answer ("" where there
    is none) and the whole row as JSON, which starts its rollout. Every prompt must have `preamble`
    before its last message."""
    items = data.to_list()
    for i, r in enumerate(items):
        p = r.get("prompt") if isinstance(r.get("prompt"), list) else [{}]
        if not p or p[-1].get("role") != "user" or not isinstance(p[-1].get("content"), str):
            raise TaskError(f"task.{split} row {i}: a verifiers prompt must end with a user message of text")
        if tuple(p[:-1]) != preamble:
            raise TaskError(
                f"task.{split} row {i}: its messages before the last differ from the first prompt's; rlkit puts "
                "the same chat messages (environment.preamble) before every prompt"
            )
    return Dataset.from_dict(
        {
            "prompt": [r["prompt"][-1]["content"] for r in items],
            "answer": [str(r.get("answer") or "") for r in items],
            "vf_input": [json.dumps(r, default=str) for r in items],
        }
    )


class VerifiersTask(Task):
    """A verifiers environment's data (`task.env`, `task.env_args`; `train_size`, `eval_size`: the
    first n rows, -1 all). Scored by the environment's rubric, so it runs with `environment=verifiers`:
    its own reward is 0 and the episode's reward is the rubric's score."""

    def __init__(self, env: str, env_args: dict | None = None, train_size: int = -1, eval_size: int = -1):
        vf_env = vf_environment(env, env_args)
        preamble = head(vf_env)
        self.train = rows(vf_env.get_dataset(train_size), "train", preamble)
        self.eval = rows(vf_env.get_eval_dataset(eval_size), "eval", preamble)
        self.requires_environment = Verifiers  # its reward is the rubric's, which only the episodes give

    def reward(self, row: dict, completion: str) -> float:
        return 0.0

    def present(self, row: dict, completion: str) -> bool:
        return bool(row["answer"]) and super().present(row, completion)

    def check_splits(self) -> None:
        for name, split in (("train", self.train), ("eval", self.eval)):
            require(len(split) > 0, f"task.env: its {name} split is empty")


@functools.cache
def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for rollouts, running in a daemon thread."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="rlkit-verifiers", daemon=True).start()
    return loop


class Verifiers(Environment):
    """The episodes of a verifiers environment (the task's `env` and `env_args`). Its own
    `max_turns` ends its episodes (`max_turns` here bounds one that sets none); `timeout_s`: how long
    the engine waits for the environment's answer to a turn (a tool call, the rubric)."""

    def __init__(self, env: str | None, env_args: dict | None = None, max_turns: int = 10, timeout_s: float = 300):
        require(env, "environment=verifiers runs the environment of task=verifiers (task.env)")
        self.vf, self.timeout_s = vf_environment(env, env_args), float(timeout_s)
        own = getattr(self.vf, "max_turns", -1)
        self.max_turns = (own if own > 0 else int(max_turns)) + 1  # the environment ends its episodes first
        tools = [t.model_dump(exclude_none=True) for t in self.vf.tool_defs or []]
        self.stop_strings = ("</tool_call>",) if tools else ()
        self.preamble = with_tools(head(self.vf), tools)

    def start(self, row: dict) -> "Episode":
        require("vf_input" in row, "environment=verifiers needs the rows of task=verifiers")
        return Episode(self, json.loads(row["vf_input"]))

    def metrics(self, episodes: list, correct: torch.Tensor) -> dict:
        outs = [e.finish() for e in episodes]
        names = sorted({k for o in outs for k in (o.get("metrics") or {})})
        out = {f"vf_{k}": sum(float((o.get("metrics") or {}).get(k, 0.0)) for o in outs) / len(outs) for k in names}
        out["vf_truncated"] = sum(bool(o.get("is_truncated")) for o in outs) / len(outs)
        out["vf_errors"] = sum(o.get("error") is not None for o in outs) / len(outs)
        return out


def with_tools(preamble: tuple, tools: list) -> tuple:
    """`preamble` with the tools described in its system message, Hermes style (one added first where
    it has none)."""
    preamble = tuple(chat_message(m) for m in preamble)
    if not tools:
        return preamble
    text = TOOLS.format("\n".join(json.dumps({"type": "function", "function": t}) for t in tools))
    if preamble and preamble[0]["role"] == "system":
        return ({"role": "system", "content": f"{preamble[0]['content']}\n\n{text}"}, *preamble[1:])
    return ({"role": "system", "content": text}, *preamble)


class Episode:
    """One rollout of the verifiers environment, turn by turn: `reply(text)` hands the model's turn to
    the rollout and returns the messages the environment appended (None once the rollout is over);
    `cut(text)` ends it where rlkit's budget did; `reward` and `correct` wait for its score."""

    def __init__(self, env: Verifiers, vf_input: dict):
        self.env, self.events, self.turns = env, queue.SimpleQueue(), 0
        self.output, self.waiting, self.history, self.texts = None, None, [], []  # texts: the model's turns
        self.unfinished = False  # whether the last of `texts` is a turn the budget cut
        rollout = env.vf.run_rollout(vf_input, engine_client_class()(self), "rlkit", {})
        asyncio.run_coroutine_threadsafe(self.run(rollout), event_loop())
        self.next_messages()  # the rollout's first model call: the prompt

    async def run(self, rollout) -> None:
        try:
            self.events.put(("done", await rollout))
        except BaseException as e:  # surfaces in the engine's thread, naming the environment
            self.events.put(("error", e))

    async def ask(self, prompt: list):
        """The rollout's model call (on the event loop): wait for the engine's turn."""
        answer = asyncio.get_running_loop().create_future()
        self.events.put(("turn", prompt, answer))
        return await answer

    def next_messages(self) -> list | None:
        """Wait for the rollout's next model call (-> the messages added since the last one) or its end (-> None)."""
        try:
            kind, *rest = self.events.get(timeout=self.env.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the rollout did not answer within {self.env.timeout_s:g} s (environment.timeout_s)")
        if kind == "error":
            raise rest[0]
        if kind == "done":
            self.output, self.waiting = rest[0], None
            return None
        prompt, self.waiting = rest
        if list(prompt[: len(self.history)]) != self.history:
            raise ConfigError(
                "environment=verifiers: its rollout rewrote the conversation before the model's last turn (a "
                "get_prompt_messages of its own?); rlkit's engine runs each episode as one growing conversation"
            )
        new, self.history = prompt[len(self.history) :], list(prompt)
        return new

    def answer(self, result, exception: bool = False) -> list | None:
        """Resolve the rollout's waiting model call with `result` (a response, or an exception to raise)."""
        how = self.waiting.set_exception if exception else self.waiting.set_result
        event_loop().call_soon_threadsafe(how, result)
        return self.next_messages()

    def reply(self, text: str) -> list | None:
        self.turns += 1
        self.texts.append(text)
        new = self.answer(response(text, self.turns, truncated=False))
        return None if new is None else [chat_message(m) for m in new[1:]]  # new[0]: the model's own turn

    def cut(self, text: str) -> None:
        """rlkit's turn or token budget ended the episode: the unfinished turn `text` (if any) goes to the
        rollout as a truncated response, and its next model call fails as an overlong prompt does."""
        if self.waiting is not None and text:
            self.texts.append(text)
            self.unfinished = True
            self.answer(response(text, self.turns + 1, truncated=True))
        if self.waiting is not None:
            from verifiers.errors import OverlongPromptError

            self.answer(OverlongPromptError("rlkit's token or turn budget ended the episode"), exception=True)

    def finish(self) -> dict:
        """The scored rollout (verifiers' output: reward, metrics, completion, ...)."""
        if self.output is None:
            self.cut("")
        return self.output

    @property
    def reward(self) -> float:
        return float(self.finish().get("reward") or 0.0)

    @property
    def correct(self) -> bool:
        return self.reward >= self.env.vf.pass_threshold


def chat_message(m) -> dict:
    """A verifiers message as the chat message rlkit's engine renders (role and text content)."""
    d = m.model_dump() if hasattr(m, "model_dump") else dict(m)
    content = d.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": d["role"], "content": content or ""}


def response(text: str, turn: int, truncated: bool):
    """A model turn as a verifiers `Response`: the text before the first tool call as its content and
    each `<tool_call>` whose body is a JSON object with a string `name` as a call (others stay text)."""
    from verifiers.types import Response, ResponseMessage, ToolCall

    calls = []
    for i, body in enumerate(CALL.findall(text)):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", {})
            calls.append(ToolCall(id=f"call_{turn}_{i}", name=call["name"], arguments=json.dumps(args)))
    content = text.split("<tool_call>")[0].rstrip() if calls else text
    finish = "length" if truncated else "tool_calls" if calls else "stop"
    message = ResponseMessage(content=content, tool_calls=calls or None, finish_reason=finish, is_truncated=truncated)
    return Response(id=f"rlkit-{turn}", created=int(time.time()), model="rlkit", message=message)


@functools.cache
def engine_client_class():
    """`EngineClient`, defined once verifiers is imported (it subclasses verifiers' `Client`)."""
    import verifiers as vf

    class EngineClient(vf.Client):
        """A verifiers chat client whose model is rlkit's engine: each call waits for the episode's next turn."""

        def __init__(self, episode: Episode):
            super().__init__(None)
            self.episode = episode

        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return list(messages), {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            return await self.episode.ask(prompt)

        async def raise_from_native_response(self, response) -> None:
            return None

        async def from_native_response(self, response):
            return response

        async def close(self) -> None:
            return None

    return EngineClient
