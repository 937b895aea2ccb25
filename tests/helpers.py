"""Test helpers without a model: rollouts built by hand from tensors (estimators, samplers), plugin
and reward-function doubles, and data-file rows."""

import json

import torch

from rlkit.components import AdvantageEstimator
from rlkit.tasks.arithmetic import Arithmetic
from rlkit.types import Rollout


def make_rollout(rewards, G, lengths=None, T=4, shaping=None):
    N = len(rewards)
    lengths = lengths or [T] * N
    mask = torch.tensor([[1] * l + [0] * (T - l) for l in lengths])  # [N, T]
    z = torch.zeros(N, 1, dtype=torch.long)
    return Rollout(
        z,
        z + 1,
        torch.zeros(N, T, dtype=torch.long),
        mask,
        torch.zeros(N, dtype=torch.bool),
        G,
        rewards=torch.tensor(rewards, dtype=torch.float),
        shaping=None if shaping is None else torch.tensor(shaping, dtype=torch.float),
    )


class NaNOnCalls(AdvantageEstimator):
    """GRPO whose advantages are NaN on the given (1-based) calls: plants a non-finite update.
    Loaded through `advantage._target_`, like any plugin."""

    def __init__(self, std: str = "sample", eps: float = 1e-6, std_scope: str = "group", calls: tuple = (2,)):
        from rlkit.advantages import GRPO

        self.inner, self.calls, self.n = GRPO(std, eps, std_scope), set(calls), 0

    def __call__(self, rollout, values=None):
        self.n += 1
        adv = self.inner(rollout)
        return adv * float("nan") if self.n in self.calls else adv


class CrashesOnCall(NaNOnCalls):
    """GRPO that raises a RuntimeError on the given (1-based) calls: a plugin that crashes mid-run."""

    def __call__(self, rollout, values=None):
        if self.n + 1 in self.calls:
            raise RuntimeError(f"plugin crashed on call {self.n + 1}")
        return super().__call__(rollout, values)


class CrashingArithmetic(Arithmetic):
    """The testbed, with a bug that crashes the run outside any plugin call rlkit checks: its
    per-step metrics raise on the second step."""

    calls = 0

    def step_metrics(self):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("task bug in step_metrics")
        return {}


def raising_reward(row, completion):
    if completion.startswith("1"):
        raise KeyError("boom")
    return 0.0


class RemoteLikeEngine:
    """An engine whose numbers are not the trainer's (as vLLM's would be): generates with rlkit's
    loop on its own copy of the policy and receives the weights after every update. Written
    without subclassing the Protocol, as a plugin may be."""

    exact_logprobs = False
    lag = None  # Engine declares it; a plugin that does not subclass the Protocol declares it too
    syncs = generations = 0

    def __init__(self, policy, tokenizer):
        import copy

        self.model, self.tokenizer = copy.deepcopy(policy).eval(), tokenizer

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        from rlkit.engines.kv_cache import generate

        RemoteLikeEngine.generations += 1
        return generate(self.model, self.tokenizer, prompts, max_new_tokens, temperature, top_p)

    def load_weights(self, policy):
        self.model.load_state_dict(policy.state_dict())
        RemoteLikeEngine.syncs += 1

    def latest(self):  # evaluation: its copy is synced after every update, so it is the trainer's policy
        return self

    def state_dict(self):  # nothing of its own to checkpoint (the copy is the policy's weights)
        return {}

    def load_state_dict(self, state):
        pass


class OldStylePlugin:
    """An estimator that declares only some of the Protocol's attributes."""

    min_group_size = 2
    needs_critic = False

    def __call__(self, rollout, values=None):
        return rollout.completion_mask.float()


class WrongShape(AdvantageEstimator):
    """An estimator with a bug: advantages of the wrong shape ('n': [N], 'n1': [N, 1], 'pg': [P, G]) or
    an exception ('raise')."""

    def __init__(self, shape: str = "n"):
        self.shape = shape

    def __call__(self, rollout, values=None):
        rewards = rollout.rewards.float()  # [N]
        if self.shape == "raise":
            raise IndexError("plugin bug")
        return {"n": rewards, "n1": rewards[:, None], "pg": rewards.view(-1, rollout.group_size)}[self.shape]


def write_plugin(root, module: str, source: str, group: str, option: str, yaml: str):
    """A plugin as a user writes it: `root/module/__init__.py` and `root/my_conf/group/option.yaml`.
    Returns the folder to put on the import path and the config folder for hydra.searchpath."""
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text(source)
    (root / "my_conf" / group).mkdir(parents=True)
    (root / "my_conf" / group / f"{option}.yaml").write_text(yaml)
    return root, root / "my_conf"


SIGN_ONLY = (
    "from rlkit.advantages import grouped, per_token\n"
    "from rlkit.components import AdvantageEstimator\n"
    "from rlkit.tensors import centred\n\n"
    "class SignOnly(AdvantageEstimator):\n"
    "    def __call__(self, rollout, values=None):\n"
    "        diff, _ = centred(grouped(rollout))\n"
    "        return per_token(diff.sign(), rollout)\n"
)


class HangingReward:
    """A reward function that never returns: a scorer stuck in a Python loop, or (`blocked`) in a
    blocking call such as a sleep or a socket read."""

    def __init__(self, weight: float = 1.0, blocked: bool = False):
        self.weight, self.blocked = weight, blocked

    def __call__(self, row, completion, task):
        import time

        while True:
            if self.blocked:
                time.sleep(3600)


class WaitsForFile:
    """The task's reward, built only once the file `path` exists: a run held in its set-up (after
    rlkit-train claimed the directory, before training) for as long as a test needs. It says that
    it waits by creating `path`.waiting."""

    def __init__(self, path: str, weight: float = 1.0):
        import os
        import time

        open(f"{path}.waiting", "w").close()
        while not os.path.exists(path):
            time.sleep(0.02)
        self.weight = weight

    def __call__(self, row, completion, task):
        return task.reward(row, completion)


class NumpyReward:
    """A reward function that returns numpy numbers, as many scorers do."""

    def __init__(self, weight: float = 1.0, value: float = 0.5, divide_by: float = 1.0):
        self.weight, self.value, self.divide_by = weight, value, divide_by

    def __call__(self, row, completion, task):
        import numpy as np

        with np.errstate(invalid="ignore", divide="ignore"):
            return np.float32(self.value) / np.float32(self.divide_by)  # 0 / 0: a NaN computed at run time


class FailsOnRank1:
    """A reward function that raises on the second process of a data-parallel run only."""

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    def __call__(self, row, completion, task):
        import os

        if os.environ.get("RANK") == "1":
            raise RuntimeError("scorer bug on rank 1")
        return 0.0


ODD = {
    "float32": lambda: __import__("numpy").float32(0.5),
    "int": lambda: 1,
    "bool": lambda: True,
    "str": lambda: "1",
    "none": lambda: None,
    "list": lambda: [1.0],
    "tensor": lambda: __import__("torch").tensor(0.5),
    "tensor2": lambda: __import__("torch").tensor([0.5, 1.0]),
    "nan": lambda: float("nan"),
    "huge": lambda: 1e308,
    "raise": lambda: 1 / 0,
    "hang": lambda: __import__("time").sleep(3600),
}


class OddReward:
    """A reward function that returns (or does) one odd thing, for fuzzing."""

    def __init__(self, kind: str, weight: float = 1.0):
        self.kind, self.weight = kind, weight

    def __call__(self, row, completion, task):
        return ODD[self.kind]()


GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]


def file_task(tmp_path, train, evals=GOOD):
    return [
        "task=files",
        f"task.train_path={write_jsonl(tmp_path / 'train.jsonl', train)}",
        f"task.eval_path={write_jsonl(tmp_path / 'eval.jsonl', evals)}",
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class Echo:
    """A multi-turn plugin environment for the character testbed (loaded through
    `environment._target_`, like any plugin): a model turn ends at EOS or at `;`, and each turn but
    the last is answered with `reply` (characters of the testbed's alphabet), each answer earning
    the per-turn reward term `turn_reward`."""

    stop_strings = (";",)
    preamble = ()

    def __init__(self, max_turns: int = 3, reply: str = "9=", turn_reward: float = 0.0):
        self.max_turns, self.reply, self.turn_reward = max_turns, reply, turn_reward

    def start(self, row: dict) -> "EchoEpisode":
        return EchoEpisode(self.max_turns, self.reply, self.turn_reward)

    def metrics(self, episodes: list, correct) -> dict:
        return {"turns": sum(e.turns for e in episodes) / len(episodes)}


class EchoEpisode:
    def __init__(self, max_turns: int, reply: str, turn_reward: float = 0.0):
        self.max_turns, self.text, self.turns, self.seen = max_turns, reply, 0, []
        self.turn_reward, self.reward = turn_reward, 0.0

    def reply(self, text: str) -> dict | None:
        self.turns += 1
        self.seen.append(text)
        if self.turns >= self.max_turns:
            return None
        self.reward += self.turn_reward
        return {"role": "tool", "content": self.text}


def reprefilled(model, tok, prompt: str, budget: int, env) -> list[int]:
    """The trajectory of one greedy episode of `env` with no cache kept across turns: each model turn
    starts from a fresh prefill of the whole history (prompt, earlier turns, the environment's
    replies), then decodes with transformers' own cache until the turn ends."""
    import torch

    from rlkit.engines.turns import reply_ids

    history, out, episode = tok(prompt)["input_ids"], [], env.start({"prompt": prompt})
    while len(out) < budget:
        turn, ended, at_eos = [], False, False
        with torch.no_grad():
            step = model(input_ids=torch.tensor([history]), use_cache=True)  # the history, prefilled afresh
            while len(out) < budget and not ended:
                nxt = int(step.logits[0, -1].argmax())
                turn, out = turn + [nxt], out + [nxt]
                at_eos = nxt == tok.eos_token_id
                ended = at_eos or any(s in tok.decode(turn) for s in env.stop_strings)
                step = model(input_ids=torch.tensor([[nxt]]), cache=step.cache, use_cache=True)
        if not ended:
            break
        message = episode.reply(tok.decode(turn, skip_special_tokens=True))
        ids = [] if message is None else reply_ids(tok, message, at_eos)
        if message is None or episode.turns >= env.max_turns or len(out) + len(ids) >= budget:
            break
        history, out = history + turn + ids, out + ids
    return out


class Breaking(Echo):
    """The Echo environment breaking its contract one way, named by `mode`: reply_str, content_int,
    no_content, metrics_list, reply_raises or start_raises; or with a bad `max_turns` (the string "3", 0)."""

    def __init__(self, mode: str = "", max_turns=3):
        super().__init__(3)
        self.mode, self.max_turns = mode, max_turns

    def start(self, row: dict):
        if self.mode == "start_raises":
            raise KeyError("difficulty")
        episode = super().start(row)
        replies = {
            "reply_str": lambda text: "9=",
            "content_int": lambda text: {"role": "tool", "content": 9},
            "no_content": lambda text: {"role": "tool"},
            "reply_raises": lambda text: 1 / 0,
        }
        episode.reply = replies.get(self.mode, episode.reply)
        return episode

    def metrics(self, episodes: list, correct) -> dict:
        return [1.0] if self.mode == "metrics_list" else super().metrics(episodes, correct)
