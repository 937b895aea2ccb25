"""What every task provides: datasets of prompts with answers, and a reward."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import math
import os
import re

import numpy as np
import torch
from datasets import Dataset, Features, Value, load_dataset

from rlkit import components
from rlkit.watchdog import WATCHDOG, TimeLimit


class TaskError(ValueError):
    """Bad task data or a reward function that failed; the message names the row."""


def read_json_text(path: str) -> Dataset:
    """A JSON-lines file (or one JSON array of objects) with every number kept as the text the file
    spells it (`007`, `1.50`, a 20-digit integer), strings as they are."""
    text = open(path, encoding="utf-8").read()
    load = functools.partial(
        json.loads, parse_int=str, parse_float=str, parse_constant=str, object_pairs_hook=_unique_keys
    )
    rows = load(text) if text.lstrip().startswith("[") else [load(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError("expected one JSON object per line (or a JSON array of objects)")
    return Dataset.from_list(rows)


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different (json's own parser keeps the last of repeated ones)."""
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"an object names the key {k!r} twice; which one is meant is not clear")
        seen[k] = v
    return seen


def read_csv_text(path: str) -> Dataset:
    """A CSV file with a header row, every value the file's text (`NA` and empty fields included);
    a byte-order mark is dropped, blank lines are skipped, and a row whose field count differs from
    the header's is named by its line."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if not any(h.strip() for h in header):
            raise ValueError("the file is empty: a CSV file needs a header row naming its columns (prompt,answer)")
        repeated = sorted({h for h in header if header.count(h) > 1})
        if repeated:
            raise ValueError(f"the header names the column {repeated[0]!r} twice; every column needs its own name")
        rows = []
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"line {reader.line_num} has {len(row)} fields, the header {len(header)}")
            rows.append(row)
    return Dataset.from_dict(
        {h: [r[i] for r in rows] for i, h in enumerate(header)}, features=Features({h: Value("string") for h in header})
    )


def load_table(
    key: str,
    source: str,
    fmt: str,
    columns: tuple,
    split: str = "train",
    config: str | None = None,
    as_text: bool = False,
) -> Dataset:
    """A local file through the `datasets` builder `fmt` (json, csv, parquet), else a hub data set
    id with its `config` and `split`; fails naming the config key, the source or a missing column.
    `as_text`: the values of a local JSON or CSV file are read as the file's text, not as numbers."""
    try:
        if os.path.exists(source) and as_text and fmt == "json":
            data = read_json_text(source)
        elif os.path.exists(source) and as_text and fmt == "csv":
            data = read_csv_text(source)
        elif os.path.exists(source):
            data = load_dataset(fmt, data_files=source, split="train")
        else:
            data = load_dataset(source, config, split=split)
    except Exception as e:
        raise TaskError(f"task.{key}: cannot load {fmt} file or data set {source!r}: {type(e).__name__}: {e}") from e
    for col in columns:
        if col not in data.column_names:
            raise TaskError(f"task.{key.removesuffix('_path')} has no '{col}' column (columns: {data.column_names})")
    return data


class Task(components.Task):
    """The defaults of a task (`rlkit.components.Task`): a subclass sets `train` and `eval`
    (`datasets.Dataset` with `prompt` and `answer`) and scores a completion against its row with
    `reward(row, completion) -> float`."""

    train: Dataset
    eval: Dataset
    demonstrations: Dataset | None = None

    @property
    def alphabet(self) -> str:
        """Characters of the prompts and answers of both splits (for a character tokenizer)."""
        text = [str(x) for split in (self.train, self.eval) for col in ("prompt", "answer") for x in split[col]]
        return "".join(sorted(set("".join(text))))

    @functools.cached_property
    def digest(self) -> dict:
        """The SHA-256 of each split's rows (as training reads them, prompts formatted), which a
        checkpoint records: a run resumed on other rows is refused."""
        return {
            name: hashlib.sha256(json.dumps(split.to_list(), sort_keys=True, default=str).encode()).hexdigest()
            for name, split in (("train", self.train), ("eval", self.eval))
        }

    def reward(self, row: dict, completion: str) -> float:
        raise NotImplementedError

    def present(self, row: dict, completion: str) -> bool:
        """A lenient score beside the reward (`eval/present`): the row's answer appears anywhere in
        the completion as a whole word or number ("22" in "so 22 it is", not in "122" or "2.22"), in
        whatever format. Where the reward is 0 but this holds, the model knew the answer and did not
        put it where the reward reads it."""
        answer = re.escape(str(row["answer"]))
        return re.search(rf"(?<![\w.]){answer}(?![\w]|\.\d)", completion) is not None

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

    def score(
        self, rows: list[dict], completions: list[str], fn=None, name: str | None = None, timeout_s: float = 0
    ) -> torch.Tensor:
        """Rewards for N completions by `fn(row, completion)` (default: the task's `reward`; `name`:
        its key under reward.functions, for messages), each call limited to `timeout_s` seconds;
        rows[i] is completion i's dataset row.  -> [N]"""
        fn = fn or self.reward
        return torch.tensor(
            [_checked(fn, i, row, text, name, timeout_s) for i, (row, text) in enumerate(zip(rows, completions))]
        )

    def score_steps(self, rows: list[dict], completions: list[str], timeout_s: float = 0) -> list[list]:
        """(end character, reward) of each step of each completion, checked like `score`."""
        return [
            _checked(self.step_rewards, i, row, text, timeout_s=timeout_s, steps=True)
            for i, (row, text) in enumerate(zip(rows, completions))
        ]


def _finite(x) -> bool:
    """A real number (Python's, numpy's or a one-element tensor's) that is finite; bools are refused."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, str):
        return False
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError, RuntimeError):
        return False


def _steps_ok(out) -> bool:
    return isinstance(out, list) and all(
        isinstance(s, (tuple, list)) and len(s) == 2 and _finite(s[0]) and _finite(s[1]) for s in out
    )


def _checked(fn, i: int, row: dict, text: str, name: str | None = None, timeout_s: float = 0, steps: bool = False):
    """Call a reward function, for at most `timeout_s` seconds (0: no limit); an exception, a
    time-out or a result that is not a finite number (`steps`: a list of (end, reward) pairs) names
    the function, the row and the completion."""
    who = f"reward.functions.{name}" if name else "the task's reward function"
    where = f"row {i} (prompt {row.get('prompt')!r}, completion {text!r})"
    try:
        with WATCHDOG.limit(timeout_s):
            out = fn(row, text)
    except TimeLimit as e:
        raise TaskError(f"{who} was stopped on {where}: {e} (reward.timeout_s={timeout_s:g})") from None
    except Exception as e:  # never score 0 silently
        raise TaskError(f"{who} raised on {where}: {type(e).__name__}: {e}") from e
    if steps:
        if not _steps_ok(out):
            raise TaskError(
                f"{who} returned {out!r} for {where}; expected a list of (end character, finite reward) pairs"
            )
        return [(int(end), float(r)) for end, r in out]
    if not _finite(out):
        raise TaskError(f"{who} returned {out!r} for {where}; expected a finite number")
    return float(out)
