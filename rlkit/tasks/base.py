"""What every task provides: datasets of prompts with answers, and a reward."""
from __future__ import annotations

import math
import os

import torch
from datasets import Dataset, load_dataset


class TaskError(ValueError):
    """Bad task data or a reward function that failed; the message names the row."""


def load_table(key: str, source: str, fmt: str, columns: tuple, split: str = "train",
               config: str | None = None) -> Dataset:
    """A local file through the `datasets` builder `fmt` (json, csv, parquet), else a hub data set
    id with its `config` and `split`; fails naming the config key, the source or a missing column."""
    try:
        if os.path.exists(source):
            data = load_dataset(fmt, data_files=source, split="train")
        else:
            data = load_dataset(source, config, split=split)
    except Exception as e:
        raise TaskError(f"task.{key}: cannot load {fmt} file or data set {source!r}: {type(e).__name__}: {e}") from e
    for col in columns:
        if col not in data.column_names:
            raise TaskError(f"task.{key.removesuffix('_path')} has no '{col}' column (columns: {data.column_names})")
    return data


class Task:
    """A task holds `train` and `eval` splits (`datasets.Dataset` with `prompt` and `answer`)
    and scores a completion against its row with `reward(row, completion) -> float`."""

    train: Dataset
    eval: Dataset

    @property
    def alphabet(self) -> str:
        """Characters of the prompts and answers of both splits (for a character tokenizer)."""
        text = [str(x) for split in (self.train, self.eval) for col in ("prompt", "answer") for x in split[col]]
        return "".join(sorted(set("".join(text))))

    def reward(self, row: dict, completion: str) -> float:
        raise NotImplementedError

    def step_rewards(self, row: dict, completion: str) -> list[tuple[int, float]]:
        """(end character index, reward) per reasoning step; one outcome step by default."""
        return [(len(completion), self.reward(row, completion))]

    def step_metrics(self) -> dict:
        """Metrics the task gathered while scoring this step (read once per step); none by default."""
        return {}

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

    def score(self, rows: list[dict], completions: list[str], fn=None) -> torch.Tensor:
        """Rewards for N completions by `fn(row, completion)` (default: the task's `reward`); rows[i]
        is completion i's dataset row.  -> [N]"""
        fn = fn or self.reward
        return torch.tensor([_checked(fn, i, row, text) for i, (row, text) in enumerate(zip(rows, completions))])

    def score_steps(self, rows: list[dict], completions: list[str]) -> list[list[tuple[int, float]]]:
        """(end character, reward) of each step of each completion, checked like `score`."""
        return [_checked(self.step_rewards, i, row, text) for i, (row, text) in enumerate(zip(rows, completions))]


def _finite(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _checked(fn, i: int, row: dict, text: str):
    """Call a reward function; an exception or a non-finite result names the row and completion."""
    where = f"row {i} (prompt {row.get('prompt')!r}, completion {text!r})"
    try:
        out = fn(row, text)
    except Exception as e:  # never score 0 silently
        raise TaskError(f"reward function raised on {where}: {type(e).__name__}: {e}") from e
    values = [r for _, r in out] if isinstance(out, list) else [out]
    if not all(_finite(v) for v in values):
        raise TaskError(f"reward function returned {out!r} for {where}; expected a finite number")
    return out if isinstance(out, list) else float(out)
