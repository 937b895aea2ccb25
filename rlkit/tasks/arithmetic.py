"""Built-in testbed: sums of small numbers, answered directly or with worked steps.

Prompt ``"3+14+5="``; a completion is either the answer alone (``"22"``) or worked partial
sums, one step per ``;``, then the answer (``"3+14=17;17+5=22;22"``). The two formats give
completions of different lengths, so length effects between variants are visible.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from rlkit.refusals import require
from rlkit.tasks.base import Task

_STEP = re.compile(r"^(\d+)\+(\d+)=(\d+)$")

ALPHABET = "0123456789+=;"


def _parse_int(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) <= 6 else None


def draw_sums(rng, n_train: int, n_eval: int, min_terms: int, max_terms: int, max_operand: int) -> tuple[list, list]:
    """`n_eval` distinct held-out sums, then `n_train` training sums (repeats allowed) none of which
    is held out.  -> (train rows, eval rows)"""

    def draw() -> dict:
        terms = [rng.randint(0, max_operand) for _ in range(rng.randint(min_terms, max_terms))]
        return {"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)), "difficulty": len(terms)}

    space = sum((max_operand + 1) ** k for k in range(min_terms, max_terms + 1))
    require(n_eval < space, f"task.n_eval={n_eval} leaves no training prompts: only {space} distinct prompts exist")
    eval_rows = {}
    while len(eval_rows) < n_eval:  # distinct held-out prompts
        row = draw()
        eval_rows[row["prompt"]] = row
    train_rows = []
    while len(train_rows) < n_train:  # held-out prompts never appear in training
        row = draw()
        if row["prompt"] not in eval_rows:
            train_rows.append(row)
    return train_rows, list(eval_rows.values())


class Arithmetic(Task):
    """Sums of `min_terms`..`max_terms` integers in [0, `max_operand`]; reward 1 for the right
    final answer, 0 for a wrong or malformed one. Each row's `difficulty` is its number of terms,
    so metrics split by it (`train/acc_d3`, `eval/acc_d3`, ...). The warm start demonstrates the
    training prompts of at most `demo_max_terms` terms (0: all), so RL can be left to extend the
    procedure to longer sums."""

    alphabet = ALPHABET

    def __init__(
        self,
        n_train: int = 4000,
        n_eval: int = 256,
        min_terms: int = 2,
        max_terms: int = 3,
        max_operand: int = 9,
        seed: int = 1234,
        worked_fraction: float = 0.5,
        demo_max_terms: int = 0,
    ):
        require(n_train >= 1 and n_eval >= 1, "task.n_train and task.n_eval must be >= 1")
        require(2 <= min_terms <= max_terms, "task.min_terms and task.max_terms need 2 <= min_terms <= max_terms")
        require(
            not (demo_max_terms and not min_terms <= demo_max_terms <= max_terms),
            "task.demo_max_terms must be 0 (every prompt) or in [task.min_terms, task.max_terms]",
        )
        self.worked_fraction = worked_fraction
        train_rows, eval_rows = draw_sums(random.Random(seed), n_train, n_eval, min_terms, max_terms, max_operand)
        self.train = Dataset.from_list(train_rows)
        self.eval = Dataset.from_list(eval_rows)
        self.demonstrations = (
            Dataset.from_list([r for r in train_rows if r["difficulty"] <= demo_max_terms])
            if demo_max_terms
            else self.train
        )

    @staticmethod
    def terms(row: dict) -> list[int]:
        """The numbers of the row's sum, from the task's own prompt (`task_prompt` when a chat
        template has rewritten `prompt`)."""
        return [int(t) for t in row.get("task_prompt", row["prompt"]).rstrip("=").split("+")]

    def demonstration(self, row: dict, rng: random.Random) -> str:
        """A correct completion for supervised warm start, worked or direct."""
        terms = self.terms(row)
        if rng.random() >= self.worked_fraction:
            return row["answer"]
        steps, acc = [], terms[0]
        for t in terms[1:]:
            steps.append(f"{acc}+{t}={acc + t}")
            acc += t
        return ";".join(steps + [str(acc)])

    @staticmethod
    def features(completion: str) -> dict:
        """`worked`: the completion shows partial sums (logged as `train/worked`, `eval/worked`, per
        difficulty): which format the policy chose."""
        return {"worked": float(";" in completion)}

    def reward(self, row: dict, completion: str) -> float:
        final = completion.split(";")[-1]
        return float(_parse_int(final) == int(row["answer"]))

    def step_rewards(self, row: dict, completion: str) -> list[tuple[int, float]]:
        """Each worked step 'a+b=c;' scores 1 if its sum is right, then the final answer scores
        1 if right; (end index, reward) per step."""
        out, pos = [], 0
        parts = completion.split(";")
        for part in parts[:-1]:
            pos += len(part) + 1
            m = _STEP.match(part)
            out.append((pos, float(bool(m) and int(m[1]) + int(m[2]) == int(m[3]))))
        out.append((len(completion), self.reward(row, completion)))
        return out


class Questions(Task):
    """The testbed's sums asked as a question, for a pretrained chat model: ``"What is 3 + 14 + 5?"``
    (`question` with `{expr}`); reward 1 when the last integer in the completion is the sum, so a
    free-form answer ("The answer is 22.") counts. The sums, splits and `difficulty` are
    `Arithmetic`'s (same arguments); there are no demonstrations, so no warm start."""

    def __init__(self, question: str = "What is {expr}?", **sums):
        require("{expr}" in question, f"task.question must contain {{expr}}, got {question!r}")
        base = Arithmetic(**sums)

        def ask(row: dict) -> dict:
            return {"prompt": question.format(expr=row["prompt"].rstrip("=").replace("+", " + "))}

        self.train, self.eval = base.train.map(ask), base.eval.map(ask)

    def reward(self, row: dict, completion: str) -> float:
        numbers = re.findall(r"-?\d+", completion.replace(",", ""))
        return float(bool(numbers) and numbers[-1] == row["answer"])
