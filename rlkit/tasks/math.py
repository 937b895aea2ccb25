"""Math word problems (GSM8K-style `#### answer`, or MATH-style `\\boxed{answer}`), read through
`datasets.load_dataset` from local files or a hub id, scored by math-verify: equivalent forms
such as `0.5`, `1/2` and `\\frac{1}{2}` count as equal."""

from __future__ import annotations

import sys

from datasets import Dataset

from rlkit.refusals import require
from rlkit.tasks.base import Task, TaskError, load_table


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def reference_answer(solution: str, style: str) -> str | None:
    """The final answer in a reference solution: after '####' (gsm8k), in the last \\boxed{} (boxed),
    or the whole text (plain)."""
    if style == "gsm8k":
        return solution.split("####")[-1].strip().replace(",", "") if "####" in solution else None
    if style == "boxed":
        return last_boxed(solution)
    return solution.strip()


class Math(Task):
    """Prompts from `question_key` through `prompt_template`, reference answers extracted from
    `answer_key` as `answer_style` says; reward 1 when math-verify finds the completion's answer
    equivalent to the reference. Verification that runs past `timeout_s` scores 0 and is counted in
    the step metric `task/verify_timeouts`."""

    STYLES = ("gsm8k", "boxed", "plain")

    def __init__(
        self,
        train: str,
        eval: str,
        format: str = "json",
        config: str | None = None,
        train_split: str = "train",
        eval_split: str = "test",
        question_key: str = "question",
        answer_key: str = "answer",
        answer_style: str = "gsm8k",
        prompt_template: str = "{question}\nPut the final answer in \\boxed{{}}.",
        timeout_s: int = 5,
    ):
        require(
            answer_style in self.STYLES,
            f"task.answer_style must be one of {', '.join(self.STYLES)}, got {answer_style!r}",
        )
        self.timeout_s, self.timeouts = timeout_s, 0
        for name, source, split in (("train", train, train_split), ("eval", eval, eval_split)):
            data = load_table(name, source, format, (question_key, answer_key), split, config)
            rows = []
            for i, row in enumerate(data):
                if row[question_key] is None or not str(row[question_key]).strip():
                    raise TaskError(f"task.{name} row {i} has no {question_key!r} (got {row[question_key]!r})")
                answer = reference_answer(str(row[answer_key]), answer_style) if row[answer_key] is not None else None
                if not answer:
                    raise TaskError(f"task.{name} row {i}: no {answer_style} answer in {str(row[answer_key])[-80:]!r}")
                rows.append({"prompt": prompt_template.format(question=row[question_key]), "answer": answer})
            setattr(self, name, Dataset.from_list(rows))
            self.unsolvable = self._warn_unsolvable(name)
        self.timeouts = 0

    def _warn_unsolvable(self, name: str) -> int:
        """Rows whose reference answer math-verify cannot match even when a completion states it
        exactly (unparsable, or past the time limit) can never score 1: counted and said once."""
        split = getattr(self, name)
        bad = [i for i, row in enumerate(split) if self.reward(row, f"\\boxed{{{row['answer']}}}") != 1.0]
        if bad:
            print(
                f"rlkit: warning: task.{name}: {len(bad)} of {len(split)} rows have a reference answer that "
                f"math-verify cannot match even against itself, so they always score 0 (rows "
                f"{', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''}; e.g. "
                f"{split[bad[0]]['answer'][:60]!r})",
                file=sys.stderr,
            )
        return len(bad)

    def reward(self, row: dict, completion: str) -> float:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException

        try:
            gold = parse(f"${row['answer']}$", parsing_timeout=self.timeout_s, raise_on_error=True)
            pred = parse(completion, parsing_timeout=self.timeout_s, raise_on_error=True)
            return float(verify(gold, pred, timeout_seconds=self.timeout_s, raise_on_error=True))
        except (Exception, TimeoutException) as e:  # unparsable answers score 0; a timeout is counted
            # (math-verify's TimeoutException is a BaseException, so it is named here)
            self.timeouts += isinstance(e, TimeoutException) or "timeout" in str(e).lower()
            return 0.0

    def step_metrics(self) -> dict:
        out, self.timeouts = {"task/verify_timeouts": self.timeouts}, 0
        return out
