"""What every task provides: datasets of prompts with answers, and a reward."""
from __future__ import annotations

import math

import torch
from datasets import Dataset


class TaskError(ValueError):
    """Bad task data or a reward function that failed; the message names the row."""


class Task:
    """A task holds `train` and `eval` splits (`datasets.Dataset` with `prompt` and `answer`)
    and scores a completion against its row with `reward(row, completion) -> float`."""

    train: Dataset
    eval: Dataset

    def reward(self, row: dict, completion: str) -> float:
        raise NotImplementedError

    def step_rewards(self, row: dict, completion: str) -> list[tuple[int, float]]:
        """(end character index, reward) per reasoning step; one outcome step by default."""
        return [(len(completion), self.reward(row, completion))]

    def check_splits(self) -> None:
        for name, split in (("train", self.train), ("eval", self.eval)):
            if len(split) == 0:
                raise TaskError(f"task.{name} split is empty")
            for col in ("prompt", "answer"):
                if col not in split.column_names:
                    raise TaskError(f"task.{name} split has no '{col}' column (columns: {split.column_names})")
            for i, (p, a) in enumerate(zip(split["prompt"], split["answer"])):
                if p is None or str(p) == "":
                    raise TaskError(f"task.{name} row {i} has no prompt")
                if a is None or str(a) == "":
                    raise TaskError(f"task.{name} row {i} ({p!r}) has no answer")

    def score(self, rows: list[dict], completions: list[str]) -> torch.Tensor:
        """Rewards for N completions; rows[i] is completion i's dataset row.  -> [N]"""
        out = []
        for i, (row, text) in enumerate(zip(rows, completions)):
            try:
                r = self.reward(row, text)
            except Exception as e:  # name the row, never score 0 silently
                raise TaskError(f"reward function raised on row {i} (prompt {row['prompt']!r}, "
                                f"completion {text!r}): {type(e).__name__}: {e}") from e
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise TaskError(f"reward function returned {r!r} for row {i} (prompt {row['prompt']!r}, "
                                f"completion {text!r}); expected a finite number")
            out.append(float(r))
        return torch.tensor(out)  # [N]
